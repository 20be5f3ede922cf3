"""Multi-turn rollouts through a generate plugin (`rollout.generate_fn`, rollout/multiturn.py) on CPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.rollout import Engine, SamplingParams
from miles.rollout.multiturn.rollout import EngineClient, EngineRefused, MultiTurnRollout, Trajectory
from miles.sample import Sample, SampleStatus
from tests.support.models import assert_pool_clean, full_forward_logprobs, rollout_config, tiny_model

pytestmark = pytest.mark.usefixtures("overlap_mode")  # each test in the sync and the overlapped step loop

TOOL = [7, 7, 3]  # what the "environment" answers after the first turn
PROMPTS = [Sample(prompt_ids=[5 + i, 6, 7, 8, 9, 10 + i], group_id=i) for i in range(3)]


def config(**overrides: object):  # noqa: ANN201
    return rollout_config(dict(kv_cache_bytes=8 * 1024 * 1024, max_batch_tokens=512), overrides)


async def two_turns(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
    traj = Trajectory(sample)
    traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=6)))
    traj.add_tokens(TOOL)
    traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=5)))
    return traj.to_sample()


PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=4, ignore_eos=True)


def test_turns_train_the_environment_does_not_and_logprobs_are_exact() -> None:
    model = tiny_model(False, seed=1)
    engine = Engine(model, None, config())
    rollout = MultiTurnRollout(engine, two_turns)
    samples = rollout.generate(PROMPTS, PARAMS)
    assert [(s.group_id, s.index) for s in samples] == [(g, i) for g in range(3) for i in range(2)]
    for s in samples:
        assert len(s.response_ids) == 6 + 3 + 5 and s.response_ids[6:9] == TOOL
        assert s.loss_mask == [1] * 6 + [0] * 3 + [1] * 5 and s.metadata["turns"] == 2
        assert s.status == SampleStatus.TRUNCATED  # the last turn ended on its length
        # Each model token's logprob is the model's, given everything before it (the tool tokens included).
        ref = full_forward_logprobs(model, s.prompt_ids, s.response_ids, 1.0, -1, 1.0, 0.0)
        keep = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs)[keep], ref[keep], atol=1e-5, rtol=0)
    assert samples[0].response_ids != samples[1].response_ids, "a group's samples should differ"
    assert rollout.metrics() == {"rollout/generate_errors": 0.0}
    assert not engine.has_unfinished
    assert_pool_clean(engine)


def test_turn_zero_is_single_turn_generation_and_reruns_repeat() -> None:
    model = tiny_model(False, seed=1)

    async def one_turn(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        traj = Trajectory(sample)
        traj.add_turn(await client.generate(traj.ids, params))
        return traj.to_sample()

    single = Engine(model, None, config()).generate(PROMPTS, PARAMS)
    plugin = MultiTurnRollout(Engine(model, None, config()), one_turn).generate(PROMPTS, PARAMS)
    assert [s.response_ids for s in plugin] == [s.response_ids for s in single]
    assert [s.rollout_logprobs for s in plugin] == [s.rollout_logprobs for s in single]
    first = MultiTurnRollout(Engine(model, None, config()), two_turns).generate(PROMPTS, PARAMS)
    again = MultiTurnRollout(Engine(model, None, config()), two_turns).generate(PROMPTS, PARAMS)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    # The second turn draws with its own seed: not the first turn's random numbers again.
    assert all(s.response_ids[9:] != s.response_ids[:5] for s in first)


def test_turns_of_different_samples_share_engine_steps_and_the_radix_cache() -> None:
    model = tiny_model(False, seed=1)
    engine = Engine(model, None, config())
    MultiTurnRollout(engine, two_turns).generate(PROMPTS, PARAMS)
    steps, prefill_tokens = engine.stats.steps, engine.stats.prefill_tokens
    metrics = engine.metrics()  # (resets the stats)
    # 6 samples x 2 turns, one after the other, would take >= 6 x (6 + 5) decode steps.
    assert steps < 30, steps
    # The second turn's prompt is the first turn's context, already cached: only the turn's last token
    # (sampled, never fed) and the tool's tokens are computed, beside each prompt once.
    prompt_tokens = sum(len(p.prompt_ids) for p in PROMPTS)
    assert prefill_tokens == prompt_tokens + len(PROMPTS) * 2 * (1 + len(TOOL)), prefill_tokens
    assert metrics["rollout/prefix_hit_rate"] > 0.5


def test_a_failing_or_hanging_plugin_costs_its_sample_only() -> None:
    model = tiny_model(False, seed=1)

    async def flaky(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        traj = Trajectory(sample)
        turn = client.generate(traj.ids, params.with_(max_new_tokens=6))
        if sample.group_id == 1 and sample.index == 0:
            _in_flight = asyncio.ensure_future(turn)  # a turn in flight when the plugin fails
            await asyncio.sleep(0)
            raise RuntimeError("tool crashed")
        traj.add_turn(await turn)
        if sample.group_id == 2 and sample.index == 1:
            await asyncio.sleep(30)  # a tool that never answers
        return traj.to_sample()

    engine = Engine(model, None, config())
    rollout = MultiTurnRollout(engine, flaky, timeout_s=0.5)
    samples = rollout.generate(PROMPTS, PARAMS)
    failed = {(s.group_id, s.index): s for s in samples if s.status == SampleStatus.ABORTED}
    assert set(failed) == {(1, 0), (2, 1)}
    assert "tool crashed" in failed[1, 0].metadata["error"] and "timed out" in failed[2, 1].metadata["error"]
    assert all(not s.response_ids and not s.loss_mask for s in failed.values())
    assert all(len(s.response_ids) == 6 for s in samples if s.status != SampleStatus.ABORTED)
    assert rollout.metrics()["rollout/generate_errors"] == 2.0
    assert not engine.has_unfinished and not engine._results, "a failed plugin's turn leaked"
    assert_pool_clean(engine)


def test_plugin_contract_errors() -> None:
    engine = Engine(tiny_model(False, seed=1), None, config())

    def not_async(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        return sample

    with pytest.raises(ValueError, match="async def generate"):
        MultiTurnRollout(engine, not_async)  # type: ignore[arg-type]

    async def bad_return(client: EngineClient, sample: Sample, params: SamplingParams) -> object:
        return {"response": [1, 2]}

    async def misaligned(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        turn = await client.generate(sample.prompt_ids, params.with_(max_new_tokens=3))
        turn.response_ids.append(1)  # without its logprob
        return turn

    for plugin, message in ((bad_return, "returns a Sample"), (misaligned, "Trajectory")):
        rollout = MultiTurnRollout(engine, plugin)  # type: ignore[arg-type]
        (sample,) = rollout.generate(PROMPTS[:1], PARAMS.with_(n=1))
        assert sample.status == SampleStatus.ABORTED and message in sample.metadata["error"]
    assert_pool_clean(engine)


def test_a_plugin_may_return_several_samples_of_its_group() -> None:
    async def per_turn(client: EngineClient, sample: Sample, params: SamplingParams) -> list[Sample]:
        first = await client.generate(sample.prompt_ids, params.with_(max_new_tokens=3))
        second = await client.generate(first.prompt_ids + first.response_ids, params.with_(max_new_tokens=3))
        return [first, second]

    samples = MultiTurnRollout(Engine(tiny_model(False, seed=1), None, config()), per_turn).generate(
        PROMPTS[:2], PARAMS
    )
    assert [(s.group_id, s.index) for s in samples] == [(g, i) for g in range(2) for i in range(4)]


def test_the_readme_calculator_plugin() -> None:
    """The README's example plugin, run against scripted model turns: the tool's answer goes in as masked
    tokens after each call, and a turn without a call ends the trajectory."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "multiturn.md").read_text()
    marker = "# calculator.py"
    code = marker + readme.split(f"```python\n{marker}", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md:calculator.py", "exec"), namespace)  # noqa: S102 - our own README

    vocab = {c: i for i, c in enumerate(sorted(set("<calc>/=0123456789+-* so.")))}
    chars = {i: c for c, i in vocab.items()}

    class ScriptedClient:
        tokenizer = None

        def __init__(self, texts: list[str]) -> None:
            self.texts, self.prompts = list(texts), []

        def encode(self, text: str) -> list[int]:
            return [vocab[c] for c in text]

        async def generate(self, ids: list[int], params: SamplingParams) -> Sample:
            self.prompts.append(list(ids))
            text = self.texts.pop(0)
            cut = text.split("</calc>")[0] if "</calc>" in params.stop and "</calc>" in text else text
            ids = self.encode(text)
            return Sample(
                response_ids=ids,
                response_text=cut,
                rollout_logprobs=[-0.5] * len(ids),
                status=SampleStatus.COMPLETED,
            )

    client = ScriptedClient(["<calc>12-7</calc>", "so <calc>3*4</calc>", "so 12."])
    prompt = Sample(prompt_ids=[vocab["s"]], group_id=0)
    out = asyncio.run(namespace["generate"](client, prompt, PARAMS.with_(n=1)))  # type: ignore[operator]
    text = "".join(chars[t] for t in out.response_ids)
    assert text == "<calc>12-7</calc>=5so <calc>3*4</calc>=12so 12."
    masked = "".join(chars[t] for t, m in zip(out.response_ids, out.loss_mask) if not m)
    assert masked == "=5=12" and out.metadata["turns"] == 3
    assert client.prompts[1] == prompt.prompt_ids + out.response_ids[: len("<calc>12-7</calc>=5")]


def test_asyncio_state_of_a_plugin_lasts_from_batch_to_batch() -> None:
    """One event loop for the rollout's life: a module-level semaphore (a client, a queue) bound to it by the
    first batch still works in the second."""
    gate = asyncio.Semaphore(2)

    async def gated(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        async with gate:
            return await client.generate(sample.prompt_ids, params.with_(max_new_tokens=3))

    rollout = MultiTurnRollout(Engine(tiny_model(False, seed=1), None, config()), gated)
    for _ in range(2):
        samples = rollout.generate(PROMPTS, PARAMS)
        assert all(s.status != SampleStatus.ABORTED for s in samples), [s.metadata for s in samples]


def test_a_batch_from_inside_a_running_event_loop() -> None:
    rollout = MultiTurnRollout(Engine(tiny_model(False, seed=1), None, config()), two_turns)

    async def notebook_cell() -> list[Sample]:
        return rollout.generate(PROMPTS[:1], PARAMS)

    assert len(asyncio.run(notebook_cell())) == 2


def test_a_misconfigured_turn_fails_the_batch_and_a_cancelled_one_its_sample() -> None:
    engine = Engine(tiny_model(False, seed=1), None, config())  # no tokenizer: stop strings cannot work

    async def stop_strings(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        return await client.generate(sample.prompt_ids, params.with_(stop=["\n"]))

    with pytest.raises(EngineRefused, match="stop strings need a tokenizer"):
        MultiTurnRollout(engine, stop_strings).generate(PROMPTS, PARAMS)
    assert_pool_clean(engine)

    async def cancels(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        turn = asyncio.ensure_future(client.generate(sample.prompt_ids, params.with_(max_new_tokens=3)))
        if sample.index == 1:
            turn.cancel()
        return await turn

    rollout = MultiTurnRollout(engine, cancels)
    samples = rollout.generate(PROMPTS, PARAMS)
    assert [s.status == SampleStatus.ABORTED for s in samples] == [False, True] * len(PROMPTS)
    assert rollout.metrics()["rollout/generate_errors"] == len(PROMPTS)
    assert not engine.has_unfinished and not engine._results
    assert_pool_clean(engine)


def test_a_plugin_s_malformed_ids_cost_its_sample_and_a_failed_batch_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine(tiny_model(False, seed=1), None, config())

    async def bad_ids(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        ids = [*sample.prompt_ids, None] if sample.group_id == 1 else sample.prompt_ids
        return await client.generate(ids, params.with_(max_new_tokens=3))  # type: ignore[arg-type]

    rollout = MultiTurnRollout(engine, bad_ids)
    samples = rollout.generate(PROMPTS, PARAMS)
    assert [s.status == SampleStatus.ABORTED for s in samples] == [False, False, True, True, False, False]
    step = Engine.step
    calls = {"n": 0}

    def failing_step(self: Engine) -> list[Sample]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return step(self)

    monkeypatch.setattr(Engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        rollout.generate(PROMPTS, PARAMS)
    monkeypatch.setattr(Engine, "step", step)
    assert not rollout._pending
    again = rollout.generate(PROMPTS, PARAMS)  # the next batch runs clean, none of the failed one's plugins
    assert [s.status == SampleStatus.ABORTED for s in again] == [False, False, True, True, False, False]
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    assert not engine.has_unfinished and not engine._results


def test_concurrent_branches_are_reproducible_whatever_order_they_finish_in() -> None:
    """Two branches from each of two contexts, launched together and awaited in either order: the same
    samples every time, and the two branches from one context differ (they take their own seeds)."""
    model = tiny_model(False, seed=1)

    def branching(reverse: bool):  # noqa: ANN202
        async def plugin(client: EngineClient, sample: Sample, params: SamplingParams) -> list[Sample]:
            contexts = [sample.prompt_ids, [*sample.prompt_ids, 7]]
            order = contexts[::-1] if reverse else contexts
            turns = [client.generate(c, params.with_(max_new_tokens=5)) for c in order for _ in range(2)]
            out = await asyncio.gather(*turns)
            return sorted(out, key=lambda s: (len(s.prompt_ids), s.response_ids))

        return plugin

    runs = [
        MultiTurnRollout(Engine(model, None, config()), branching(reverse)).generate(
            PROMPTS[:2], PARAMS.with_(n=1)
        )
        for reverse in (False, True)
    ]
    assert [s.response_ids for s in runs[0]] == [s.response_ids for s in runs[1]]
    assert runs[0][0].response_ids != runs[0][1].response_ids  # two branches from one context


def test_a_trajectory_whose_turn_the_engine_refused_keeps_the_reason() -> None:
    """An aborted sample says why in `metadata["error"]` (Sample's contract): a turn whose prompt the
    environment pushed past the context is aborted by the engine, and the trajectory carries its error."""
    engine = Engine(tiny_model(False, seed=1), None, config())

    async def overflowing(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        traj = Trajectory(sample)
        traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=3)))
        traj.add_tokens([7] * client.max_context)
        traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=3)))
        return traj.to_sample()

    out = MultiTurnRollout(engine, overflowing).generate(PROMPTS[:1], PARAMS.with_(n=1))[0]
    assert out.status == SampleStatus.ABORTED and "context" in out.metadata["error"]
    assert len(out.loss_mask) == len(out.response_ids) == len(out.rollout_logprobs) == 3 + engine.max_context
    # A later turn that goes through clears it: the status and the error are the last turn's.
    traj = Trajectory(PROMPTS[0])
    traj.add_turn(Sample(prompt_ids=[1], status=SampleStatus.ABORTED, metadata={"error": "x"}))
    traj.add_turn(
        Sample(prompt_ids=[1], response_ids=[4], rollout_logprobs=[-1.0], status=SampleStatus.COMPLETED)
    )
    assert "error" not in traj.to_sample().metadata and traj.to_sample().status == SampleStatus.COMPLETED
    assert not engine.has_unfinished
    assert_pool_clean(engine)


def test_a_turn_that_outgrows_a_kv_pool_smaller_than_the_context_is_truncated() -> None:
    """The engine aborts a request that outgrows its KV pool (which drops a trajectory from training): the
    client caps a turn where the pool ends, so it ends TRUNCATED there, with the tokens it would have drawn."""
    from miles.rollout.kv.pool import KVLayout

    model = tiny_model(False, seed=1)
    per_token = KVLayout.for_model(model.args, model.dtype, 1, False).bytes_per_token
    engine = Engine(model, None, config(kv_cache_bytes=(40 + 1) * per_token))
    assert engine.pool.capacity_tokens == 40 < engine.max_context
    seen: list[int] = []

    async def one_turn(client: EngineClient, sample: Sample, params: SamplingParams) -> Sample:
        seen.append(client.max_context)
        traj = Trajectory(sample)
        traj.add_turn(await client.generate(traj.ids, params))
        return traj.to_sample()

    params = PARAMS.with_(max_new_tokens=100)
    out = MultiTurnRollout(engine, one_turn).generate(PROMPTS[:2], params)
    free = Engine(model, None, config()).generate(PROMPTS[:2], params)
    assert seen == [41] * 4
    for s, ref in zip(out, free, strict=True):
        assert s.status == SampleStatus.TRUNCATED and "error" not in s.metadata, s.metadata
        assert len(s.prompt_ids) + len(s.response_ids) == 41
        assert s.response_ids == ref.response_ids[: len(s.response_ids)]
    assert not engine.has_unfinished
    assert_pool_clean(engine)
