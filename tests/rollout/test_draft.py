"""Speculative decoding with a draft model (`rollout.speculative=draft`, rollout/draft_model.py): the samples
are plain decoding's whatever the draft proposes, the draft's draws share plain decoding's random numbers,
and its own KV cache follows preemption, chunked prefill, weight updates and memory release."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.models import CausalLM, save_pretrained
from miles.rollout.engine import Engine
from miles.rollout.kv.pool import KVLayout
from miles.rollout.sampling.params import SamplingParams
from miles.rollout.spec import draft_model, draws
from miles.sample import SampleStatus
from tests.rollout.test_engine import PROMPTS, assert_same_samples, config, kv_bytes
from tests.support.models import assert_pool_clean, tiny_model


def noisy_copy(model: CausalLM, scale: float, seed: int = 3) -> CausalLM:
    """The model with every weight moved by a little noise: a draft close to it, not equal."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return draft


def draft_run(  # noqa: ANN201
    model: CausalLM,
    draft: CausalLM,
    prompts,
    params,
    decoded_catch_up: bool = False,
    **cfg,  # noqa: ANN001
):
    engine = Engine(model, None, config(speculative="draft", **cfg), draft_model=draft)
    assert engine.spec.drafter is not None
    # As on CUDA with graphs: the tokens a verify step kept go to the draft as decode steps.
    engine.spec.drafter.decoded_catch_up = decoded_catch_up
    samples = engine.generate(prompts, params)
    assert_pool_clean(engine)
    return samples, engine


PEAKY_PROMPTS = [PROMPTS[0] * 2, PROMPTS[4], PROMPTS[3] * 3, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3]


@pytest.mark.parametrize(
    "setup",
    ["close_draft_tiny_pool_chunks_pages", "close_draft_decoded_catch_up", "moe_model_dense_draft"],
)
def test_draft_model_speculation_gives_the_same_samples(setup: str) -> None:
    """Tokens and statuses are plain decoding's, logprobs to float32 rounding, with a draft close to the
    model (many drafts accepted) under preemption, chunked prefill (the draft's catch-up is chunked by the
    same budget) and pages of 4, the kept tokens fed to the draft in one forward or as decode steps; and with an unrelated dense draft for a MoE model (few accepted)."""
    if setup == "moe_model_dense_draft":
        model = tiny_model(True, seed=5, max_position_embeddings=64)
        draft = tiny_model(False, seed=9, max_position_embeddings=64)
        cfg: dict = {}
    else:
        model = tiny_model(False, seed=5, max_position_embeddings=64)
        with torch.no_grad():  # peaky logits, so that stop ids are drawn and requests end early too
            model.lm_head.weight.mul_(4.0)
        draft = noisy_copy(model, 0.002)
        cfg = dict(
            kv_cache_bytes=kv_bytes(model, 140, page_size=4),
            page_size=4,
            max_batch_tokens=7,
            max_running_requests=6,
        )
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=30, seed=7, stop_token_ids=[41])
    plain_cfg = {k: v for k, v in cfg.items() if k != "kv_cache_bytes"}
    plain = Engine(model, None, config(**plain_cfg)).generate(PEAKY_PROMPTS, params)
    decoded = setup == "close_draft_decoded_catch_up"
    got, engine = draft_run(model, draft, PEAKY_PROMPTS, params, decoded, spec_draft_tokens=3, **cfg)
    assert_same_samples(got, plain)
    m = engine.metrics()
    assert m["rollout/spec_steps"] > 0 and m["rollout/spec_draft_s"] > 0
    assert m["rollout/spec_proposed_tokens"] == m["rollout/spec_draft_tokens"]  # no filler without graphs
    if setup == "moe_model_dense_draft":
        assert m["rollout/spec_accepted_tokens"] < 0.5 * m["rollout/spec_draft_tokens"]
    else:
        assert {s.status for s in plain} == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}
        assert m["rollout/preemptions"] > 0, "the tiny pool was meant to force preemption"
        assert m["rollout/spec_accepted_tokens"] > 0.3 * m["rollout/spec_draft_tokens"]


def test_draft_draws_share_plain_decodings_random_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model drafting for itself at temperature 1 proposes the very tokens plain decoding then samples,
    since each draft is drawn with the uniform number of its response position: nearly every draft is
    accepted. With other uniform numbers the two draws agree only by chance."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=11, ignore_eos=True)
    plain = Engine(model, None, config()).generate(PROMPTS, params)
    got, engine = draft_run(model, copy.deepcopy(model), PROMPTS, params)
    assert_same_samples(got, plain)
    coupled = engine.metrics()
    assert coupled["rollout/spec_accepted_tokens"] >= 0.95 * coupled["rollout/spec_draft_tokens"]
    assert coupled["rollout/spec_accept_length"] > 4.0
    shifted = draws.uniforms_of_mixed

    def other_numbers(mixed, positions):  # noqa: ANN001, ANN202
        return (shifted(mixed, positions) + 0.5) % 1.0

    monkeypatch.setattr(draws, "uniforms_of_mixed", other_numbers)
    got, engine = draft_run(model, copy.deepcopy(model), PROMPTS, params)
    assert_same_samples(got, plain)
    independent = engine.metrics()
    assert independent["rollout/spec_accepted_tokens"] < 0.5 * independent["rollout/spec_draft_tokens"]


def test_the_draft_pool_shares_the_budget_and_follows_updates_and_release() -> None:
    """The draft's pool holds as many tokens as the engine's, the two inside rollout.kv_cache_bytes; a weight
    update that restarts requests (update_policy=retract) drops the draft's cache of their old output (the
    draft's own weights do not change), and a memory release frees and restores the draft's pool too."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    draft = noisy_copy(old, 0.002)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    budget = 2 * 1024 * 1024
    engine = Engine(old, None, config(speculative="draft", kv_cache_bytes=budget), draft_model=draft)
    per_token = sum(KVLayout.for_model(m.args, m.dtype, 1).bytes_per_token for m in (old, draft))
    assert (
        engine.spec.drafter is not None
        and engine.spec.drafter.pool.capacity_tokens == engine.pool.capacity_tokens
    )
    assert (
        (engine.pool.capacity_tokens + 1) * per_token
        <= budget
        < (engine.pool.capacity_tokens + 2) * per_token
    )
    rids = [engine.add_request(p, greedy) for p in PROMPTS]
    for _ in range(2):  # the prompts, then a verify step: every request has a draft sequence
        engine.step()
    assert len(engine.spec.drafter.seqs) == len(PROMPTS)
    engine.update_weights(new.state_dict(), version=1)
    while engine.has_unfinished:
        engine.step()
    on_new = Engine(new, None, config()).generate(PROMPTS, greedy)
    assert [engine.take_result(r).response_ids for r in rids] == [s.response_ids for s in on_new]
    assert_pool_clean(engine)
    engine.release_memory()
    assert not engine.spec.drafter.pool.allocated and not engine.spec.drafter.seqs
    engine.resume_memory()
    assert_same_samples(engine.generate(PROMPTS, greedy), on_new)
    assert_pool_clean(engine)


@pytest.mark.parametrize("verify_graphs", [False, True], ids=["eager_verify", "graph_verify"])
def test_no_draft_is_computed_for_a_step_that_cannot_verify_it(
    verify_graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight requests decode at once, and their drafts would need 32 rows of the step's 24: the scheduler would
    drop all of them. The engine asks the draft model only for the drafts the step can verify: the first
    requests' (five of them with 3 drafts each), or with verify graphs (forced here through the eager path, as on the GPU), which need every
    request drafted alike, none. Every drafted token is then verified."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    cfg = config(speculative="draft", spec_draft_tokens=3, max_batch_tokens=24, max_running_requests=8)
    engine = Engine(model, None, cfg, draft_model=copy.deepcopy(model))
    if verify_graphs:
        engine.spec.verify_batch_limit = 64
    assert engine.spec.drafter is not None
    proposed: list[tuple[int, int]] = []  # (requests drafted for, draft tokens)
    propose = engine.spec.drafter.propose

    def counted(reqs, ks):  # noqa: ANN001, ANN202
        drafts = propose(reqs, ks)
        proposed.append((len(reqs), sum(map(len, drafts))))
        return drafts

    engine.spec.drafter.propose = counted  # type: ignore[method-assign]
    got = engine.generate(PROMPTS[:2], params)
    assert_same_samples(got, Engine(model, None, config()).generate(PROMPTS[:2], params))
    m = engine.metrics()
    assert sum(tokens for _, tokens in proposed) == m["rollout/spec_proposed_tokens"], (proposed, m)
    if verify_graphs:
        assert m["rollout/spec_steps"] == 0 and not any(n for n, _ in proposed), proposed
    else:
        # 8 rows plus at most 16 drafts: five requests' 3 drafts, more of them near the end where k shrinks.
        assert (5, 15) in proposed and max(tokens for _, tokens in proposed) <= 16, proposed
        assert m["rollout/spec_steps"] > 0
    assert_pool_clean(engine)


def test_the_draft_model_is_checked_and_loaded_from_its_path(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model(seed=0)
    with pytest.raises(ValueError, match="spec_draft_model"):
        Engine(model, None, config(speculative="draft"))
    with pytest.raises(ValueError, match="off, ngram, draft or head"):
        Engine(model, None, config(speculative="eagle"))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, None, config(speculative="draft"), draft_model=tiny_model(seed=0, vocab_size=100))
    # A checkpoint folder without tokenizer files (the model's tokenizer is used).
    path = save_pretrained(noisy_copy(model, 0.002), tmp_path / "draft")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine = Engine(model, None, config(speculative="draft", spec_draft_model=str(path)))
    assert_same_samples(
        engine.generate(PROMPTS, greedy), Engine(model, None, config()).generate(PROMPTS, greedy)
    )
    assert engine.metrics()["rollout/spec_accepted_tokens"] > 0
    # A smaller vocabulary: the model's ids the draft lacks reach it as its last id (prompts hold 92, 89, ...).
    small = Engine(model, None, config(speculative="draft"), draft_model=tiny_model(seed=2, vocab_size=80))
    plain = Engine(model, None, config()).generate(PROMPTS, greedy)
    assert_same_samples(small.generate(PROMPTS, greedy), plain)
    assert small.metrics()["rollout/spec_steps"] > 0
    assert_pool_clean(small)
    # Deterministic mode never speculates, so it loads no draft.
    assert Engine(model, None, config(speculative="draft", deterministic=True)).spec is None


@pytest.mark.parametrize("share", [True, False], ids=["shared", "each_its_own"])
def test_a_groups_samples_share_their_prompt_in_the_draft_pool(share: bool) -> None:
    """The n = 8 samples of a group fork from one prefill in the engine; in the draft's pool too they hold
    and compute their 160-token prompt once (each is fed only its own output), so a pool the size of the
    engine's drafts for nearly all of them. Without sharing, every sample feeds the prompt again and the
    draft pool fills after a few. The samples are plain decoding's either way, and every slot comes back."""
    model = tiny_model(False, seed=5, max_position_embeddings=512)
    prompt = list(range(1, 81)) * 2
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=16, seed=1, ignore_eos=True)
    cfg = config(
        speculative="draft",
        spec_draft_tokens=3,
        kv_cache_bytes=kv_bytes(model, 600, page_size=1) * 2,
        max_batch_tokens=512,
    )
    engine = Engine(model, None, cfg, draft_model=copy.deepcopy(model))
    drafter = engine.spec.drafter
    assert drafter is not None and drafter.pool.capacity_tokens == engine.pool.capacity_tokens >= 600
    drafter.share_prompts = share
    fed, asked, got = [0], [0], [0]
    forward, propose = drafter._forward, drafter.propose

    def counted_forward(seqs, lens, *rest):  # noqa: ANN001, ANN002, ANN202
        fed[0] += int(lens.sum())
        return forward(seqs, lens, *rest)

    def counted_propose(reqs, ks):  # noqa: ANN001, ANN202
        drafts = propose(reqs, ks)
        asked[0] += len(reqs)
        got[0] += sum(1 for d in drafts if d)
        return drafts

    drafter._forward, drafter.propose = counted_forward, counted_propose  # type: ignore[method-assign]
    samples = engine.generate([prompt], params)
    assert_same_samples(samples, Engine(model, None, config()).generate([prompt], params))
    assert_pool_clean(engine)
    assert not drafter.prompts
    outputs = sum(len(s.response_ids) for s in samples)  # 128
    if share:
        # The prompt once, then each sample's output and drafts (measured: 272 tokens; 32 of 39 drafted).
        assert fed[0] <= len(prompt) + 2 * outputs, fed
        assert got[0] >= 0.75 * asked[0], (got, asked)
    else:  # measured: 1,392 tokens fed, 25 of 51 drafted
        assert fed[0] >= 4 * len(prompt), fed
        assert got[0] < 0.6 * asked[0], (got, asked)


def test_requests_are_admitted_while_drafts_fill_the_step() -> None:
    """Six requests decode with 3 drafts each (24 rows of the step's 24 tokens) while a seventh waits: drafts
    leave half of what decoding leaves to the waiting request's prefill, which starts at once instead of
    after the six have finished."""
    model = tiny_model(False, seed=5, max_position_embeddings=512)
    cfg = config(speculative="draft", spec_draft_tokens=3, max_batch_tokens=24, max_running_requests=8)
    engine = Engine(model, None, cfg, draft_model=copy.deepcopy(model))
    long = SamplingParams(temperature=1.0, max_new_tokens=150, seed=1, ignore_eos=True)
    for i in range(6):
        engine.add_request([1 + i, 2, 3], long, index=i)
    for _ in range(3):
        engine.step()
    late = engine.add_request(list(range(10)), SamplingParams(temperature=0.0, max_new_tokens=2))
    steps = 0
    while (result := engine.take_result(late)) is None and steps < 36:
        engine.step()
        steps += 1
    assert result is not None and len(result.response_ids) == 2
    assert steps <= 3, steps  # 36 steps (until the six finished) when drafts took the whole budget
    assert engine.metrics()["rollout/spec_steps"] > 0


def test_a_draft_model_out_of_memory_costs_only_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    engine = Engine(model, None, config(speculative="draft"), draft_model=copy.deepcopy(model))

    def out_of_memory(*args):  # noqa: ANN002, ANN202
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(draft_model.DraftModel, "_catch_up", out_of_memory)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert_same_samples(
        engine.generate(PROMPTS, greedy), Engine(model, None, config()).generate(PROMPTS, greedy)
    )
    assert engine.metrics()["rollout/spec_steps"] == 0
    assert_pool_clean(engine)


def test_a_sequence_past_the_drafts_context_gives_its_slots_back() -> None:
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    draft = tiny_model(False, seed=9, max_position_embeddings=16)
    engine = Engine(model, None, config(speculative="draft"), draft_model=draft)
    assert engine.spec.drafter is not None
    engine.add_request(
        list(range(1, 11)), SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    )
    for _ in range(12):  # past position 16: no more drafts, and no slots held for them
        engine.step()
    assert not engine.spec.drafter.seqs
    assert engine.spec.drafter.pool.free_tokens == engine.spec.drafter.pool.capacity_tokens


def test_requests_asking_for_alternatives_decode_without_drafts() -> None:
    """Alternatives are read per plain sample row: a request with `top_logprobs` gets no drafts, the others
    in its batch still do, and the samples stay plain decoding's."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    engine = Engine(model, None, config(speculative="draft"), draft_model=copy.deepcopy(model))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4, ignore_eos=True)
    asking = [engine.add_request(p, params.with_(top_logprobs=2)) for p in PROMPTS[:2]]
    others = [engine.add_request(p, params) for p in PROMPTS[2:]]
    while engine.has_unfinished:
        engine.step()
    alternatives = [engine.take_result(r) for r in asking]
    plain = [engine.take_result(r) for r in others]
    assert all(s.spec_stats == {} and s.top_logprobs and len(s.top_logprobs) == 12 for s in alternatives)
    assert all(s.spec_stats["verify_steps"] > 0 and s.top_logprobs is None for s in plain)
    expected = Engine(model, None, config()).generate(PROMPTS, params)
    assert [s.response_ids for s in alternatives + plain] == [s.response_ids for s in expected]
    assert_pool_clean(engine)


def test_a_group_shares_its_prompt_when_its_first_sample_ends_at_its_first_verify_step() -> None:
    """Regression (found by review): the n - 1 samples that skip drafting while the first computes their
    prompt in the draft's pool must find it there at the next step, even if that first sample finished in the
    very verify step (all its drafts accepted up to max_new_tokens, or a stop id). Its prompt went back to the
    pool with it, so the next sample computed it again while the rest skipped again: one request drafted a
    step and the prompt was fed once per sample. Now the waiting samples hold the prompt until they attach."""
    model = tiny_model(False, seed=5, max_position_embeddings=128)
    prompt = list(range(1, 41))
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=5, seed=1, ignore_eos=True)
    engine = Engine(
        model, None, config(speculative="draft", spec_draft_tokens=3), draft_model=copy.deepcopy(model)
    )
    drafter = engine.spec.drafter
    assert drafter is not None
    fed, proposals = [0], []
    forward, propose = drafter._forward, drafter.propose

    def counted_forward(seqs, lens, *rest):  # noqa: ANN001, ANN002, ANN202
        fed[0] += int(lens.sum())
        return forward(seqs, lens, *rest)

    def counted_propose(reqs, ks):  # noqa: ANN001, ANN202
        drafts = propose(reqs, ks)
        if reqs:
            proposals.append((len(reqs), sum(1 for d in drafts if d)))
        return drafts

    drafter._forward, drafter.propose = counted_forward, counted_propose  # type: ignore[method-assign]
    samples = engine.generate([prompt], params)
    assert_same_samples(samples, Engine(model, None, config()).generate([prompt], params))
    assert_pool_clean(engine)
    # The first sample computes the prompt and keeps all 3 drafts (5 tokens: done); the other 7 attach next.
    assert proposals[:2] == [(8, 1), (7, 7)], proposals
    assert fed[0] <= len(prompt) + 8 * params.max_new_tokens, fed
    assert engine.stats.decode_steps == 2
    assert not drafter.prompts and not drafter.reserved
