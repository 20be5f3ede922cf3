"""An engine in its own process (miles/placement/engine_process.py): it generates what an engine in this
process generates on the same weights, before and after a sync, and its samples carry the weight version
they were generated with, requests in flight during a sync included."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.placement.engine_process import EngineProcess, EngineProcessError, Finished
from miles.rollout import SamplingParams
from miles.sample import Sample
from miles.weight_sync import TransportWeightSync, make_sender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import TIMEOUT_S, tiny_engine

PROMPTS = [[3, 14, 15, 92, 65, 35], [2, 71, 82], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SEEDED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=1234)


def drawn(samples: list[Sample]) -> list[tuple]:
    return [(s.group_id, s.index, s.response_ids, s.rollout_logprobs, s.status) for s in samples]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_generate_sync_generate_matches_an_engine_in_this_process(
    moe: bool, engine_process: Callable[..., EngineProcess]
) -> None:
    engine = engine_process(moe)
    version = engine.weight_version
    here = tiny_engine(moe, seed=0)  # the engine process started from the same (seed 0) weights
    here.update_weights([], version)
    for params in (GREEDY, SEEDED):
        assert drawn(engine.generate(PROMPTS, params)) == drawn(here.generate(PROMPTS, params))

    trainer = tiny_model(moe, seed=5)
    sender = make_sender("shm", [engine.sync_channel], 8 / 1024, TIMEOUT_S)
    sender.connect()
    try:
        result = TransportWeightSync(trainer, sender).sync(version + 1)
    finally:
        sender.close()
    assert result.checksum_ok

    here_new = tiny_engine(moe, seed=5)
    here_new.update_weights([], version + 1)
    for params in (GREEDY, SEEDED):
        remote = engine.generate(PROMPTS, params)
        assert drawn(remote) == drawn(here_new.generate(PROMPTS, params))
        assert {s.weight_version for s in remote} == {version + 1}
    assert engine.metrics()["rollout/weight_version"] == version + 1


@pytest.mark.parametrize("policy", ["retract", "finish"])
def test_requests_in_flight_during_a_sync_follow_the_update_policy(
    policy: str, engine_process: Callable[..., EngineProcess]
) -> None:
    """Submitted, then a sync before the answer: each sample is what an engine on the weights of the version
    it carries generates (retract: the new weights, as the sync arrives between the engine's steps; finish:
    the old ones)."""
    engine = engine_process(False, update_policy=policy)
    old_version = engine.weight_version
    new_version = old_version + 1
    long = SamplingParams(n=2, temperature=0.0, max_new_tokens=64, ignore_eos=True)
    on = {
        old_version: drawn(tiny_engine(seed=0).generate(PROMPTS, long)),
        new_version: drawn(tiny_engine(seed=6).generate(PROMPTS, long)),
    }
    sender = make_sender("shm", [engine.sync_channel], 8 / 1024, TIMEOUT_S)
    sender.connect()
    try:
        request = engine.submit(PROMPTS, long)
        result = TransportWeightSync(tiny_model(seed=6), sender).sync(new_version)
    finally:
        sender.close()
    assert result.checksum_ok
    samples = engine.result(request, TIMEOUT_S)
    versions = {s.weight_version for s in samples}
    assert len(versions) == 1, "one generate call's requests are in flight together"
    (version,) = versions
    # retract: in flight when the sync arrived, restarted on the new weights; finish: done on the old ones
    assert version == (new_version if policy == "retract" else old_version)
    assert drawn(samples) == on[version]


def test_errors_come_back_named(engine_process: Callable[..., EngineProcess]) -> None:
    engine = engine_process(False)
    with pytest.raises(EngineProcessError, match="text prompts need a tokenizer"):
        engine.generate(["no tokenizer here"], GREEDY)
    with pytest.raises(EngineProcessError, match="unknown engine call"):
        engine.call("shutdown_everything")
    assert engine.generate(PROMPTS[:1], GREEDY)[0].response_ids  # still serving


def test_a_streamed_generate_hands_over_each_sample_as_it_finishes(
    engine_process: Callable[..., EngineProcess],
) -> None:
    engine = engine_process(False)
    # every 8th token ends a sample, so the 9 samples finish over several steps
    staggered = SamplingParams(
        n=3, temperature=1.0, max_new_tokens=24, seed=7, stop_token_ids=list(range(0, 64, 8))
    )
    batches: list[int] = []
    file = engine._file

    def counting(message: object) -> None:
        if isinstance(message, Finished):
            batches.append(len(message.samples))
        file(message)

    engine._file = counting  # type: ignore[method-assign]
    try:
        seen: list[Sample] = []
        streamed = engine.generate(PROMPTS, staggered, on_finish=seen.append)
    finally:
        del engine._file
    whole = engine.generate(PROMPTS, staggered)
    # the same samples in the same order (logprobs up to the prefix cache's prefill rounding)
    assert [(s.group_id, s.index, s.response_ids, s.status) for s in streamed] == [
        (s.group_id, s.index, s.response_ids, s.status) for s in whole
    ]
    for one, other in zip(streamed, whole):
        assert one.rollout_logprobs == pytest.approx(other.rollout_logprobs, abs=1e-5)
    assert sorted(drawn(seen)) == sorted(drawn(streamed))
    assert len({len(s.response_ids) for s in streamed}) > 1 and len(batches) > 1 and sum(batches) == 9


class _StaggeredEngine:
    """Request `rid` finishes at step `rid + 1`: the engine process's host loop without a model."""

    tokenizer = None

    def __init__(self) -> None:
        self.steps, self.added, self.taken = 0, 0, set()

    def add_request(self, ids: list[int], params: SamplingParams, **_: object) -> int:
        self.added += 1
        return self.added - 1

    def take_result(self, rid: int) -> Sample | None:
        if rid >= self.steps or rid in self.taken:
            return None
        self.taken.add(rid)
        return Sample(prompt="", index=rid, response_ids=[rid])


@pytest.mark.parametrize("stream", [True, False])
def test_the_host_streams_finished_samples_before_the_reply(stream: bool) -> None:
    from multiprocessing import Pipe

    from miles.placement.engine_process import Generate, Reply, _Host

    ours, theirs = Pipe()
    engine = _StaggeredEngine()
    host = _Host(engine, theirs)  # type: ignore[arg-type]
    host.handle(Generate(7, [[1, 2], [3]], SamplingParams(max_new_tokens=4), stream=stream))
    messages = []
    for _ in range(3):
        engine.steps += 1
        host.reply_finished()
        while ours.poll():
            messages.append(ours.recv())
    if stream:
        assert [type(m) for m in messages] == [Finished, Finished, Reply]
        assert [(m.positions, [s.index for s in m.samples]) for m in messages[:2]] == [([0], [0]), ([1], [1])]
        assert messages[2].value is None and messages[2].request == 7
    else:
        assert [type(m) for m in messages] == [Reply]
        assert [s.index for s in messages[0].value] == [0, 1]
    assert not host.pending and not host.streamed
