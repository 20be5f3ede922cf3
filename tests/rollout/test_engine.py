"""Engine vs references: transformers' greedy `generate`, full-forward logprobs, prefill counts, preemption.

Tiny random float32 Qwen3 / Qwen3-MoE models; the transformers models are loaded from checkpoints written by
`miles.models.save_pretrained`, so both sides hold the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.config import RolloutConfig
from miles.models import CausalLM, save_pretrained
from miles.rollout import Engine, SamplingParams
from miles.rollout.kv.pool import KVLayout
from miles.sample import Sample, SampleStatus
from tests.support.models import assert_pool_clean, full_forward_logprobs, hf_logq, rollout_config, tiny_model

NEW_TOKENS = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The CI machine has 2 shared cores; one intra-op thread avoids barrier stalls on these tiny ops.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def kv_bytes(model: CausalLM, tokens: int, page_size: int = 1, record_routing: bool = False) -> int:
    """A pool budget holding `tokens` usable tokens (plus the reserved page)."""
    layout = KVLayout.for_model(model.args, model.dtype, page_size, record_routing)
    return (tokens + page_size) * layout.bytes_per_token


pytestmark = pytest.mark.usefixtures("overlap_mode")


def config(**overrides: object) -> RolloutConfig:
    return rollout_config(
        dict(kv_cache_bytes=8 * 1024 * 1024, max_batch_tokens=512, max_running_requests=64), overrides
    )


PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79],
    [2, 71, 82],
    [3, 14, 15, 92, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [50, 51, 52, 53, 54, 55],
    [7] * 20,
]


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3", "qwen3_moe"])
def model_and_hf_greedy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = tiny_model(request.param)
    path = save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "model")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    return model, expected


SETUPS = {
    "plain": {},
    "tiny_pool_preempts": {"pool_tokens": 60},
    "chunked_prefill": {"max_batch_tokens": 6, "max_running_requests": 4},
    "pages_of_4": {"page_size": 4},
    "pages_tiny_pool": {"page_size": 4, "pool_tokens": 64, "max_batch_tokens": 8, "max_running_requests": 8},
    "speculative": {"speculative": "ngram"},
    "speculative_pages_tiny_pool": {"speculative": "ngram", "page_size": 4, "pool_tokens": 64},
    # A chunked prefill can leave a prompt's last token alone: no draft before the first output token.
    "speculative_chunked_prefill": {"speculative": "ngram", "max_batch_tokens": 7, "max_running_requests": 4},
}


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no_radix"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_matches_transformers(model_and_hf_greedy, radix: bool, setup: str) -> None:
    model, expected = model_and_hf_greedy
    overrides = dict(SETUPS[setup])
    pool_tokens = overrides.pop("pool_tokens", None)
    cfg = config(radix_cache=radix, **overrides)
    if pool_tokens is not None:
        cfg.kv_cache_bytes = kv_bytes(model, pool_tokens, cfg.page_size)
    engine = Engine(model, None, cfg)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=NEW_TOKENS)
    for _ in range(2):  # the second round runs against a warm radix cache
        samples = engine.generate(PROMPTS, params)
        got = [s.response_ids for s in samples]
        assert got == [e for e in expected for _ in range(2)]
        assert all(s.status == SampleStatus.TRUNCATED for s in samples)
        assert [s.group_id for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(2)]
        assert [s.index for s in samples] == [0, 1] * len(PROMPTS)
        assert_pool_clean(engine)
    metrics = engine.metrics()
    if pool_tokens is not None:
        assert metrics["rollout/preemptions"] > 0, "the tiny pool was meant to force preemption"
    if cfg.speculative != "off":  # drafts were verified, and some were right
        assert metrics["rollout/spec_accepted_tokens"] > 0 and metrics["rollout/spec_accept_length"] > 1
    if radix:  # the second round finds its prompts cached unless the tiny pool evicted them
        assert metrics["rollout/prefix_hit_rate"] > (0.2 if pool_tokens else 0.5)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, -1, 1.0, 0.0), (0.7, 20, 0.9, 0.0), (1.3, -1, 0.8, 0.05)]
)
def test_logprobs_equal_a_full_forward(
    moe: bool, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    model = tiny_model(moe, seed=1)
    engine = Engine(model, None, config(max_batch_tokens=16, max_running_requests=16))  # mixed, chunked steps
    params = SamplingParams(
        n=3, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_new_tokens=16, seed=5
    )
    samples = engine.generate(PROMPTS, params)
    for s in samples:
        assert len(s.rollout_logprobs) == len(s.response_ids) == len(s.loss_mask) == 16
        ref = full_forward_logprobs(model, s.prompt_ids, s.response_ids, temperature, top_k, top_p, min_p)
        assert torch.isfinite(ref).all()
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    assert len({tuple(s.response_ids) for s in samples}) > len(PROMPTS), "n samples of a prompt should differ"


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (0.7, 20, 0.9, 0.0)]
)
def test_alternatives_are_the_most_likely_tokens_of_the_sampled_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    """`top_logprobs=5`: per response token, the 5 most likely tokens under the distribution it was drawn from
    (transformers' warpers over a full forward; greedy: the temperature-1 log-softmax), those a filter drops
    left out; the sampled token's logprob is its entry there. Requests without it in the same batch get
    None, and the samples are those drawn without alternatives."""
    model = tiny_model(False, seed=1)
    engine = Engine(model, None, config(max_batch_tokens=16, max_running_requests=16))  # mixed, chunked steps
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_new_tokens=12, seed=5
    )
    rids = [engine.add_request(p, params.with_(top_logprobs=5)) for p in PROMPTS]
    plain_rid = engine.add_request(PROMPTS[0], params)
    while engine.has_unfinished:
        engine.step()
    samples = [engine.take_result(r) for r in rids]
    assert engine.take_result(plain_rid).top_logprobs is None
    assert engine._alternative_requests == 0  # steps look for alternatives again only when asked
    expected = Engine(model, None, config()).generate(PROMPTS, params)
    assert [s.response_ids for s in samples] == [s.response_ids for s in expected]
    for s in samples:
        assert s.top_logprobs is not None and len(s.top_logprobs) == len(s.response_ids)
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids]))[0, len(s.prompt_ids) - 1 : -1]
        for row, token, logprob, alternatives in zip(
            logits, s.response_ids, s.rollout_logprobs, s.top_logprobs
        ):
            if temperature == 0.0:
                ref = torch.log_softmax(row, dim=-1)
            else:
                ref = hf_logq(row, temperature, top_k, top_p, min_p)
            values, ids = ref.topk(5)
            kept = [(int(t), float(v)) for t, v in zip(ids, values) if v > -math.inf]
            assert [t for t, _ in alternatives] == [t for t, _ in kept]
            torch.testing.assert_close(
                torch.tensor([v for _, v in alternatives]),
                torch.tensor([v for _, v in kept]),
                atol=1e-5,
                rtol=0,
            )
            if token in dict(alternatives):
                assert dict(alternatives)[token] == pytest.approx(logprob, abs=1e-5)
    assert_pool_clean(engine)


def test_grpo_groups_prefill_each_prompt_once() -> None:
    model = tiny_model(False, seed=2)
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i, 11, 12, 13, 14 + i] * 3 for i in range(4)]
    n = 8
    counts = {}
    for radix in (True, False):
        engine = Engine(model, None, config(radix_cache=radix))
        samples = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=6, seed=0))
        assert len(samples) == len(prompts) * n
        counts[radix] = engine.metrics()
        assert_pool_clean(engine)
    lengths = [len(p) for p in prompts]
    # With the radix cache: each prompt exactly once. The other n-1 samples fork from the one that computes
    # it (their first token comes from its last logits row), so they compute no prompt token at all.
    assert counts[True]["rollout/prefill_tokens"] == sum(lengths)
    assert counts[True]["rollout/cached_prompt_tokens"] == sum((n - 1) * length for length in lengths)
    assert counts[False]["rollout/prefill_tokens"] == n * sum(lengths)
    assert counts[False]["rollout/prefix_hit_rate"] == 0.0


@pytest.mark.parametrize("page_size", [1, 4])
def test_group_samples_fork_from_one_prefill_and_decode_in_lockstep(page_size: int) -> None:
    """The other samples of a group take their first token from the prefill of the one that computes the
    prompt, so all n decode side by side: one prefill step, then max_new_tokens - 1 decode steps. With pages,
    a prompt that ends inside a page cannot share that page; its samples compute the rest themselves."""
    model = tiny_model(True, seed=6)
    n, new_tokens = 4, 6
    prompts = [PROMPTS[0], [4, 5, 6, 7] * 3]  # 8 and 12 tokens: whole pages of 4
    engine = Engine(model, None, config(page_size=page_size))
    samples = engine.generate(
        prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=3)
    )
    assert engine.stats.steps == new_tokens, "every sample of a group decodes in the same steps"
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)
    for s in samples:
        ref = full_forward_logprobs(model, s.prompt_ids, s.response_ids, 1.0, -1, 1.0, 0.0)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    assert len({tuple(s.response_ids) for s in samples}) > len(prompts), "forks draw their own tokens"
    assert_pool_clean(engine)
    if page_size > 1:
        engine = Engine(model, None, config(page_size=page_size))
        odd = [PROMPTS[2]]  # 14 tokens: the forks would need the leader's half-filled last page
        engine.generate(odd, SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=3))
        # The others match the 12 tokens of whole pages and compute the last two themselves.
        assert engine.stats.prefill_tokens == 14 + (n - 1) * 2
        assert_pool_clean(engine)


def test_a_fork_whose_prompt_is_not_cached_computes_it_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a fork cannot find its whole prompt in the radix cache after the step, it goes back to the queue
    (its drawn token dropped) and computes what it lacks; its samples are still exact."""
    model = tiny_model(False, seed=7)
    engine = Engine(model, None, config())
    attach = engine.kv.attach_forks
    failed: list[int] = []

    def attach_failing_one_once(reqs: list) -> list:
        if failed:
            return attach(reqs)
        first = reqs[0]
        failed.append(first.rid)
        engine.kv.table.free(first.row)
        first.row = -1
        return [first, *attach(reqs[1:])]

    monkeypatch.setattr(engine.kv, "attach_forks", attach_failing_one_once)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=9)
    samples = engine.generate(PROMPTS[:2], params)
    assert failed and all(s.status == SampleStatus.TRUNCATED for s in samples)
    assert all(len(s.response_ids) == 8 for s in samples)
    for s in samples:
        ref = full_forward_logprobs(model, s.prompt_ids, s.response_ids, 1.0, -1, 1.0, 0.0)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    assert engine.stats.dropped_rows == 1
    # The requeued fork counts as admitted once, when it really computes: every prompt token is either
    # cached or computed.
    s = engine.stats
    assert s.prompt_tokens == 3 * sum(len(p) for p in PROMPTS[:2])
    assert s.cached_prompt_tokens + s.prefill_tokens == s.prompt_tokens
    assert_pool_clean(engine)


def test_moe_engine_in_float64() -> None:
    """Dtypes the CPU grouped GEMM does not take (float64) run the experts' loop instead."""
    model = tiny_model(True, seed=8).double()
    engine = Engine(model, None, config())
    samples = engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    for s in samples:
        ref = full_forward_logprobs(model, s.prompt_ids, s.response_ids, 1.0, -1, 1.0, 0.0)
        torch.testing.assert_close(
            torch.tensor(s.rollout_logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0
        )


def test_abort_and_errors_do_not_disturb_other_requests() -> None:
    model = tiny_model(False, seed=3, max_position_embeddings=32)
    engine = Engine(model, None, config())
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    reference = engine.generate(PROMPTS[:2], params)
    too_long = list(range(1, 33))  # 32 tokens: no room for one more in a 32-token context
    rids = [
        engine.add_request(PROMPTS[0], params),
        engine.add_request(too_long, params),
        engine.add_request(PROMPTS[1], params),
        engine.add_request([], params),
    ]
    for _ in range(4):
        engine.step()
    engine.abort(rids[2])
    while engine.has_unfinished:
        engine.step()
    first, long_one, aborted, empty = (engine.take_result(r) for r in rids)
    assert first.response_ids == reference[0].response_ids
    assert long_one.status == SampleStatus.ABORTED and "context" in long_one.metadata["error"]
    assert empty.status == SampleStatus.ABORTED and "empty" in empty.metadata["error"]
    assert aborted.status == SampleStatus.ABORTED and aborted.metadata["error"] == "aborted by the caller"
    assert 0 < len(aborted.response_ids) < 10
    assert aborted.response_ids == reference[1].response_ids[: len(aborted.response_ids)]
    assert_pool_clean(engine)


def test_generation_stops_at_the_context_length() -> None:
    model = tiny_model(False, seed=3, max_position_embeddings=24)
    engine = Engine(model, None, config())
    (s,) = engine.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_new_tokens=50))
    assert s.status == SampleStatus.TRUNCATED and len(s.prompt_ids) + len(s.response_ids) == 24


def test_a_prompt_larger_than_the_pool_fails_alone() -> None:
    model = tiny_model(False, seed=3)
    engine = Engine(model, None, config(kv_cache_bytes=kv_bytes(model, 16)))
    # PROMPTS[0] + 10 new tokens would need 17 slots: it stops where the pool is full (the newest token needs
    # none); PROMPTS[4] (20 tokens) can never start.
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert samples[0].status == SampleStatus.TRUNCATED and len(samples[0].response_ids) == 10
    assert samples[1].status == SampleStatus.TRUNCATED and len(samples[1].response_ids) == 17 - 8
    assert (
        samples[2].status == SampleStatus.ABORTED and "KV pool holds only 16" in samples[2].metadata["error"]
    )
    assert_pool_clean(engine)


POOL_CAPPED = {
    "plain": {},
    "pages_of_4": {"page_size": 4},  # 26 tokens of budget hold 6 pages of 4: 24 tokens
    "speculative": {"speculative": "ngram"},
    "speculative_pages_of_4": {"speculative": "ngram", "page_size": 4},
}


@pytest.mark.parametrize("setup", list(POOL_CAPPED))
def test_a_request_that_outgrows_a_pool_smaller_than_the_context_is_truncated(setup: str) -> None:
    """A request alone that reaches the pool's capacity ends TRUNCATED there (as at the context's end), with
    the first tokens and logprobs an engine with room gives, instead of ABORTED with nothing to train on."""
    model = tiny_model(False, seed=1)
    with torch.no_grad():  # peaky logits: the model repeats itself, so n-gram drafts get proposed and kept
        model.lm_head.weight.mul_(8.0)
    overrides = POOL_CAPPED[setup]
    page_size = int(overrides.get("page_size", 1))
    budget = 26 if page_size > 1 else 24  # page-rounded down to 24 tokens
    engine = Engine(model, None, config(kv_cache_bytes=kv_bytes(model, budget, page_size), **overrides))
    assert engine.pool.capacity_tokens == 24
    prompt = [1, 2, 3, 1, 2, 3]
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    (wide,) = Engine(model, None, config()).generate([prompt], params)
    for _ in range(2):  # the second time with the prompt in the radix cache
        (s,) = engine.generate([prompt], params)
        assert s.status == SampleStatus.TRUNCATED, s.metadata.get("error")
        assert len(prompt) + len(s.response_ids) == 25  # the newest token needs no slot
        assert s.response_ids == wide.response_ids[:19]
        torch.testing.assert_close(
            torch.tensor(s.rollout_logprobs), torch.tensor(wide.rollout_logprobs[:19]), atol=1e-5, rtol=0
        )
        assert_pool_clean(engine)
    if engine.spec is not None:
        assert engine.metrics()["rollout/spec_accepted_tokens"] > 0


def generate_per_setting(
    model: CausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    field: str,
    values: tuple[str, str],
    **cfg,
) -> dict[str, tuple[list[Sample], Engine]]:
    """The same requests under each value of one rollout config field; each engine's pool ends clean."""
    runs = {}
    for value in values:
        engine = Engine(model, None, config(**{field: value}, **cfg))
        runs[value] = (engine.generate(prompts, params), engine)
        assert_pool_clean(engine)
    return runs


def assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    """Tokens and statuses equal; logprobs to float32 rounding (the batches differ, so do the sums' orders)."""
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.status for s in got] == [s.status for s in want]
    for a, b in zip(got, want):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def overlap_off_and_on(
    model: CausalLM, prompts: list[list[int]], params: SamplingParams
) -> dict[str, tuple[list[Sample], Engine]]:
    """The same requests with overlap scheduling off and on, in a pool of 40 tokens (it preempts)."""
    return generate_per_setting(
        model,
        prompts,
        params,
        "overlap_schedule",
        ("off", "on"),
        kv_cache_bytes=kv_bytes(model, 40, record_routing=True),
        max_running_requests=16,
        record_routing=True,
    )


def test_overlap_schedule_gives_the_same_samples() -> None:
    """Requests that stop early (a stop id, the context end, a tiny pool) get one extra decode row under
    overlap scheduling; its result must be dropped and its KV slot given back."""
    model = tiny_model(True, seed=4, max_position_embeddings=40)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3]
    params = SamplingParams(
        n=4, temperature=1.0, max_new_tokens=24, seed=11, stop_token_ids=[5, 17, 33], return_routing=True
    )
    runs = overlap_off_and_on(model, prompts, params)
    (off, off_engine), (on, on_engine) = runs["off"], runs["on"]
    dropped = (off_engine.stats.dropped_rows, on_engine.stats.dropped_rows)  # before metrics() resets them
    assert_same_samples(on, off)
    statuses = {s.status for s in off}
    assert statuses == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}, (
        "stop ids and the context end both hit"
    )
    assert off_engine.metrics()["rollout/preemptions"] > 0, "the pool was meant to force preemption"
    assert all(-1 not in s.response_ids for s in on)
    # A request must not be retracted while its token is in flight: it would finish outside the running set
    # and lose its routing (needed for routing replay).
    assert all(s.routed_experts is not None for s in on)
    assert [s.routed_experts.tolist() for s in on] == [s.routed_experts.tolist() for s in off]
    assert dropped[0] == 0 and dropped[1] > 0, "early stops ran a dropped row"


def test_speculative_decoding_gives_the_same_samples() -> None:
    """Draft rows sample with the uniform numbers plain decoding would use at those positions, so n-gram
    speculation changes no token (only the float32 rounding of logprobs), whatever stops the request."""
    model = tiny_model(False, seed=5, max_position_embeddings=48)
    with torch.no_grad():  # peaky logits: the model repeats itself, so drafts get accepted while sampling
        model.lm_head.weight.mul_(8.0)
    prompts = [PROMPTS[0] * 2, PROMPTS[4], PROMPTS[3] * 3, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3]
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=30, seed=7, stop_token_ids=[41])
    runs = generate_per_setting(
        model,
        prompts,
        params,
        "speculative",
        ("off", "ngram"),
        kv_cache_bytes=kv_bytes(model, 120),
        max_running_requests=12,
    )
    (off, _), (on, _) = runs["off"], runs["ngram"]
    metrics = {mode: engine.metrics() for mode, (_, engine) in runs.items()}
    assert_same_samples(on, off)
    assert {s.status for s in off} == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}
    assert metrics["ngram"]["rollout/spec_accepted_tokens"] > 0
    assert metrics["ngram"]["rollout/spec_accept_length"] > 1.0
    assert (
        sum(s.spec_stats.get("accepted_tokens", 0) for s in on)
        == metrics["ngram"]["rollout/spec_accepted_tokens"]
    )
    assert metrics["off"]["rollout/spec_draft_tokens"] == 0 and all(not s.spec_stats for s in off)
    # Without verify graphs every draft token is an n-gram's proposal.
    assert metrics["ngram"]["rollout/spec_proposed_tokens"] == metrics["ngram"]["rollout/spec_draft_tokens"]
    assert (
        sum(s.spec_stats.get("proposed_tokens", 0) for s in on)
        == metrics["ngram"]["rollout/spec_proposed_tokens"]
    )


@pytest.mark.parametrize("limit", [64, 9])
def test_graph_verify_drafts_are_uniform_and_exact(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where verify steps replay CUDA graphs (GPU), a step drafts exactly spec_draft_tokens for every running
    request, n-gram drafts padded with filler tokens, or drafts nothing: only when nothing waits, every
    running request decodes, and their number is within the graphs' limit. Run here through the eager path
    with that policy forced: the samples are still plain decoding's, and every verify batch is uniform."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    with torch.no_grad():  # peaky logits: the model repeats itself, so some drafts are right
        model.lm_head.weight.mul_(8.0)
    prompts = [PROMPTS[0] * 2, PROMPTS[4], PROMPTS[3] * 3, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3]
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=30, seed=7, stop_token_ids=[41])
    plain = Engine(model, None, config()).generate(prompts, params)
    engine = Engine(model, None, config(speculative="ngram", spec_draft_tokens=3))
    engine.spec.verify_batch_limit = limit
    shapes: list[tuple[int, int, int]] = []  # (verify_len, batch, running) of every drafted step
    forward = engine.runner.forward

    def recorded(batch):  # noqa: ANN001, ANN202
        if any(n > 1 for n in batch.q_lens) and batch.sample_index.numel() == batch.num_tokens:
            shapes.append((batch.verify_len, batch.batch_size, len(engine.scheduler.running)))
        return forward(batch)

    engine.runner.forward = recorded  # type: ignore[method-assign]
    spec = engine.generate(prompts, params)
    assert_same_samples(spec, plain)
    assert_pool_clean(engine)
    assert shapes, "nothing was drafted"
    assert all(length == 4 and batch == running <= limit for length, batch, running in shapes), shapes
    metrics = engine.metrics()
    assert metrics["rollout/spec_draft_tokens"] == 3 * sum(batch for _, batch, _ in shapes)
    assert 0 < metrics["rollout/spec_proposed_tokens"] < metrics["rollout/spec_draft_tokens"]  # filler too
    assert metrics["rollout/spec_accepted_tokens"] > 0


def test_no_retraction_while_a_token_is_in_flight() -> None:
    """Regression (found by review): under overlap, a preemption could pick a request whose stopping token was
    still on the device; it then finished from the waiting queue without its KV row, so its MoE routing was
    lost and routing replay failed. Now the scheduler waits for the token instead of retracting."""
    model = tiny_model(True, seed=24, max_position_embeddings=64)
    prompts = [[21, 49, 73, 88, 36, 70], [49, 93, 73, 1, 31, 84, 2], [19, 19, 92, 40, 21, 32, 83, 88, 79, 74]]
    prompts.append([15, 75, 4])
    params = SamplingParams(
        n=2, temperature=1.0, max_new_tokens=20, seed=442, stop_token_ids=[36, 94, 27, 9], return_routing=True
    )
    runs = overlap_off_and_on(model, prompts, params)
    (off, _), (on, _) = runs["off"], runs["on"]
    assert [s.response_ids for s in on] == [s.response_ids for s in off]
    assert all(s.routed_experts is not None for s in on)
    assert [s.routed_experts.tolist() for s in on] == [s.routed_experts.tolist() for s in off]


def test_no_draft_before_the_first_output_token() -> None:
    """Regression (found by review): with a chunked prefill leaving the prompt's last token alone, that chunk
    got a draft, and the radix cache took in draft positions (a -1 key, then a slot freed twice)."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    prompt = [57, 10, 93] * 5 + [57, 10]  # 17 tokens: chunks of 8, 8 and 1
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    plain = Engine(model, None, config(radix_cache=False)).generate([prompt], params)[0]
    for page_size in (1, 4):
        cfg = config(speculative="ngram", max_batch_tokens=8, max_running_requests=8, page_size=page_size)
        engine = Engine(model, None, cfg)
        (sample,) = engine.generate([prompt], params)
        assert sample.response_ids == plain.response_ids
        assert_pool_clean(engine)
        engine.flush_cache()
        assert engine.pool.free_tokens == engine.pool.capacity_tokens


def test_a_prompts_last_token_alone_is_prefill_not_a_plain_decode() -> None:
    """A chunked prefill that stops one token short leaves the last prompt token to a one-token chunk that
    looks like a decode; the step is not a plain decode step: the token is counted, and cached, as prompt."""
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    prompt = [57, 10, 93] * 5 + [57, 10]  # 17 tokens: chunks of 8, 8 and 1
    engine = Engine(model, None, config(max_batch_tokens=8, max_running_requests=8))
    plans = []
    schedule = engine.scheduler.schedule

    def recorded(in_flight: bool = False) -> object:
        plans.append(schedule(in_flight))
        return plans[-1]

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    (sample,) = engine.generate([prompt], params)
    assert [p.plain_decode for p in plans if p.chunks] == [False] * 3 + [True] * 4
    assert (engine.stats.prefill_tokens, engine.stats.decode_tokens) == (17, 4)
    ref = full_forward_logprobs(model, prompt, sample.response_ids, 1.0, -1, 1.0, 0.0)
    torch.testing.assert_close(torch.tensor(sample.rollout_logprobs), ref, atol=1e-5, rtol=0)
    engine.generate([prompt], params.with_(max_new_tokens=1))
    assert (
        engine.stats.cached_prompt_tokens == 16
    )  # all the second request could take: its whole prompt is cached


class _GraphsOutOfMemory:
    """Stands in for the CUDA-graph runner: every replay (its capture first) runs out of device memory."""

    def __init__(self) -> None:
        self.replays, self.resets = 0, 0

    def fits(self, batch: object) -> bool:
        return True

    def replay(self, batch: object) -> None:
        self.replays += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    def reset(self) -> None:
        self.resets += 1

    def sample(self, logits: object, st: object) -> None:
        return None  # no graph replayed: the eager sampler


def test_graph_capture_out_of_memory_falls_back_to_eager_decode(caplog: pytest.LogCaptureFixture) -> None:
    """A capture that runs out of memory costs the graphs, not the run: decode goes on eagerly, same samples."""
    model = tiny_model(moe=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    expected = Engine(model, None, config()).generate(prompts, params)
    engine = Engine(model, None, config())
    stub = _GraphsOutOfMemory()
    engine.runner.graphs = stub  # type: ignore[assignment]
    with caplog.at_level("WARNING"):
        got = engine.generate(prompts, params)
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert [s.rollout_logprobs for s in got] == [s.rollout_logprobs for s in expected]
    assert stub.replays == 1 and stub.resets == 1 and engine.runner.graphs is None
    assert "decoding without CUDA graphs" in caplog.text


def test_a_row_handed_to_a_new_request_is_not_staged_from_the_old_one() -> None:
    """CPU decode staging keeps a row's gathered keys between steps. A request that finishes frees its
    table row; the next request to get that row, with a prompt one token longer than the old sequence and
    all but one token cached, looks like the old request one token further. It must be attended from its
    own keys (the same tokens as without staging)."""
    model = tiny_model(False, seed=1, max_position_embeddings=200)

    def run(staging: bool) -> list[int]:
        engine = Engine(model, None, config(page_size=1, max_running_requests=4))
        if not staging:
            engine.runner.staging = None
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        cached = [(7 * i + 3) % 96 for i in range(40)]
        engine.generate([cached], greedy.with_(max_new_tokens=2))  # its tokens stay in the radix cache
        # 20 + 6 tokens: its last step attends over 25 positions of row 0, then frees the row.
        engine.generate([[(11 * i + 5) % 96 for i in range(20)]], greedy.with_(max_new_tokens=6))
        # Row 0 again; 25 cached tokens and one to compute: a one-token step over 26 positions.
        return engine.generate([cached[:25] + [42]], greedy.with_(max_new_tokens=4))[0].response_ids

    assert run(staging=True) == run(staging=False)


def test_sampling_params_changed_in_place_take_effect() -> None:
    """The engine reuses the last step's sampling tensors while the rows' settings stay the same; a caller
    that changes a SamplingParams object between calls gets the new settings."""
    model = tiny_model(False, seed=1)
    prompt = [5, 6, 7, 8, 9]
    engine = Engine(model, None, config())
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    engine.generate([prompt], params)
    params.temperature = 0.0  # the same object, now greedy
    got = engine.generate([prompt], params)[0].response_ids
    greedy = Engine(model, None, config()).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=8)
    )
    assert got == greedy[0].response_ids


def test_max_new_tokens_lowered_below_the_output_ends_the_request() -> None:
    """A caller that lowers `max_new_tokens` in place below what running requests already produced gets them
    back, truncated to the new limit (the first tokens of the same samples), instead of a generate that never
    returns; their keys and values past the limit go back to the pool."""
    model = tiny_model(False, seed=1)
    engine = Engine(model, None, config(page_size=4))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    for index in range(3):
        engine.add_request([5, 6, 7, 8, 9], params, group_id=0, index=index)
    for _ in range(6):
        engine.step()
    params.max_new_tokens = 2
    finished = []
    for _ in range(10):
        finished += engine.step()
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished
    assert len(finished) == 3
    assert all(s.status == SampleStatus.TRUNCATED for s in finished)
    assert all(len(s.response_ids) == len(s.rollout_logprobs) == 2 for s in finished)
    full = Engine(model, None, config(page_size=4)).generate(
        [[5, 6, 7, 8, 9]], params.with_(max_new_tokens=20)
    )
    by_index = {s.index: s for s in finished}
    assert [by_index[s.index].response_ids for s in full] == [s.response_ids[:2] for s in full]
    assert_pool_clean(engine)


def _retracted_pair(cfg: RolloutConfig) -> tuple[Engine, SamplingParams, SamplingParams]:
    """(engine, lowered, other): two requests of 40 tokens (groups 0 and 1, each its own params object)
    decoded 12 steps, then both retracted: they wait, with their outputs so far."""
    engine = Engine(tiny_model(False, seed=1), None, cfg)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, ignore_eos=True)
    lowered, other = params.with_(), params.with_()
    engine.add_request([5, 6, 7, 8, 9], lowered, group_id=0, index=0)
    engine.add_request([5, 6, 7, 8, 10], other, group_id=1, index=0)
    for _ in range(12):
        engine.step()
    engine._drain()
    engine.scheduler.retract_all()
    return engine, lowered, other


def _lowered_to_three(engine: Engine, lowered: SamplingParams) -> tuple[int, int]:
    """Lower the limit to 3 and run to the end: (the step the lowered request ended at, the other's); both
    samples checked (3 tokens, TRUNCATED; 40 tokens)."""
    lowered.max_new_tokens = 3
    ended: dict[int, tuple[int, Sample]] = {}
    for step in range(80):
        for sample in engine.step():
            ended[sample.group_id] = (step, sample)
        if not engine.has_unfinished:
            break
    (step_lowered, cut), (step_other, full) = ended[0], ended[1]
    assert cut.status == SampleStatus.TRUNCATED and len(cut.response_ids) == len(cut.rollout_logprobs) == 3
    assert len(full.response_ids) == 40
    assert_pool_clean(engine)
    return step_lowered, step_other


def test_a_lowered_limit_ends_its_request_while_others_run() -> None:
    """The request whose limit was lowered ends at the next step, not once the others are done; one that
    had been retracted (its output then sits in the radix cache, shared with the tree) gives back only its
    own keys and values; one whose stopping token lay past the new limit ends TRUNCATED, not COMPLETED."""
    engine, lowered, _ = _retracted_pair(config(page_size=4))
    for _ in range(2):  # both re-admitted: their prefixes come from the tree
        engine.step()
    step_lowered, step_other = _lowered_to_three(engine, lowered)
    assert step_lowered <= 2 < step_other


def test_a_limit_lowered_while_waiting_ends_the_request_without_recomputing_it() -> None:
    """A retracted request whose max_new_tokens is lowered to at most its output while it waits is not
    re-admitted (its prompt and output prefilled again, one more token sampled) only to be cut: it ends at
    the next step, TRUNCATED, and only the other request is recomputed."""
    engine, lowered, other = _retracted_pair(config(radix_cache=False))
    (waiting_other,) = [r for r in engine.scheduler.waiting if r.params is other]
    recompute = waiting_other.seq_len  # without a radix cache: its prompt and output, all of them
    computed = engine.stats.prefill_tokens
    step_lowered, _ = _lowered_to_three(engine, lowered)
    assert step_lowered <= 2
    assert engine.stats.prefill_tokens - computed == recompute


def test_a_stop_token_past_the_lowered_limit_truncates() -> None:
    """Overlap scheduling: the step in flight when the limit is lowered may sample a stop token past it;
    the request still ends TRUNCATED with the tokens up to the limit."""
    model = tiny_model(False, seed=1)
    prompt = [5, 6, 7, 8, 9]
    base = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    out = Engine(model, None, config(overlap_schedule="on")).generate([prompt], base)[0].response_ids
    stop_at = next(i for i in range(4, 20) if out[i] not in out[:i])
    engine = Engine(model, None, config(overlap_schedule="on"))
    params = base.with_(stop_token_ids=[out[stop_at]])
    engine.add_request(prompt, params)
    while True:  # until the stop token is the one in flight
        engine.step()
        req = engine.scheduler.running[0]
        if len(req.output_ids) == stop_at + 1 and req.pending_index >= 0:
            break
    params.max_new_tokens = 2
    done: list[Sample] = []
    while engine.has_unfinished:
        done += engine.step()
    assert done[0].status == SampleStatus.TRUNCATED and done[0].response_ids == out[:2]
    assert_pool_clean(engine)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_decode_staging_gives_the_same_samples(speculative: str) -> None:
    """Staged CPU decode (keys, values and plans carried between steps) against gathering every step, on a
    workload that changes its rows often: shared-prefix groups of different sizes, chunked prefill beside
    decodes, a pool small enough to retract requests, stop ids, and n-gram verify steps."""
    model = tiny_model(False, seed=1, max_position_embeddings=200)
    base = [(13 * i + 7) % 96 for i in range(20)]
    prompts = [base + [1, 2], base + [3], [(5 * i + 1) % 96 for i in range(12)], base, [9, 8, 7]]
    params = [
        SamplingParams(n=n, temperature=t, max_new_tokens=m, seed=s, stop_token_ids=[stop])
        for n, t, m, s, stop in [
            (3, 1.0, 30, 1, 17),
            (2, 0.0, 25, 2, 90),
            (1, 0.8, 30, 3, 5),
            (3, 1.0, 12, 4, 60),
            (2, 1.0, 30, 5, 33),
        ]
    ]
    cfg = dict(
        kv_cache_bytes=kv_bytes(model, 64),
        max_batch_tokens=24,
        max_running_requests=16,
        page_size=1,
        speculative=speculative,
        spec_draft_tokens=3,
    )

    def run(staging: bool) -> tuple[list[Sample], int]:
        engine = Engine(model, None, config(**cfg))
        if not staging:
            engine.runner.staging = None
        rids = [
            engine.add_request(p, sp, group_id=i, index=j)
            for i, (p, sp) in enumerate(zip(prompts, params))
            for j in range(sp.n)
        ]
        while engine.has_unfinished:
            engine.step()
        return [engine.take_result(r) for r in rids], engine.stats.preemptions

    (staged, preemptions), (gathered, _) = run(True), run(False)
    assert preemptions > 0, "the pool was meant to retract requests"
    assert [s.response_ids for s in staged] == [s.response_ids for s in gathered]
    for a, b in zip(staged, gathered):
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)


def test_a_request_retracted_and_ended_while_waiting_keeps_its_routing() -> None:
    """A request that waits with output but no KV (retracted) and whose max_new_tokens is lowered in place to
    its output ends there: its routing comes from the radix cache its KV went into; where the cache lost
    it, the sample is aborted (routing replay could not train on it), not returned without routing."""
    model = tiny_model(True, seed=1)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, ignore_eos=True, return_routing=True)
    reference = Engine(model, None, config(record_routing=True, overlap_schedule="off")).generate(
        [prompt], params
    )[0]
    for release in (False, True):
        engine = Engine(model, None, config(record_routing=True, overlap_schedule="off"))
        lowered = params.with_()
        rid = engine.add_request(prompt, lowered)
        for _ in range(12):
            engine.step()
        if release:
            engine.release_memory()  # the whole pool, the cache too, is given back
            engine.resume_memory()
        else:
            engine.scheduler.retract_all()  # as preemption does: its KV goes into the radix cache
        lowered.max_new_tokens = 3
        while engine.has_unfinished:
            engine.step()
        sample = engine.take_result(rid)
        if release:
            assert sample.status == SampleStatus.ABORTED and "routing" in sample.metadata["error"]
        else:
            assert sample.status == SampleStatus.TRUNCATED
            assert sample.response_ids == reference.response_ids[:3]
            fed = len(prompt) + 3 - 1
            assert torch.equal(sample.routed_experts, reference.routed_experts[:fed])
        assert_pool_clean(engine)


def test_admission_reserves_only_the_tokens_the_context_leaves() -> None:
    """A max_new_tokens past the context is valid (the context truncates the request): admission must not
    reserve pool room for tokens the context will never let it generate."""
    model = tiny_model(False, seed=1, max_position_embeddings=64)
    prompts = [[(7 * i + j) % 96 for j in range(8)] for i in range(8)]
    engine = Engine(model, None, config(kv_cache_bytes=kv_bytes(model, 600)))  # 8 x 64 = 512 slots fit
    params = SamplingParams(temperature=1.0, max_new_tokens=1000, seed=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, group_id=i)
    most = 0
    while engine.has_unfinished:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 8 and engine.stats.preemptions == 0  # one at a time before
    assert_pool_clean(engine)


def test_a_group_whose_prompt_ends_inside_a_page_starts_together() -> None:
    """The radix cache keeps whole pages: the other samples of a group wait one step for the leader's whole
    pages, never for its partial last page (which no step puts in the cache)."""
    model = tiny_model(False, seed=1)
    engine = Engine(model, None, config(page_size=4))
    admitted: list[int] = []
    schedule = engine.scheduler.schedule

    def counting(*args: object, **kwargs: object) -> object:
        before = len(engine.scheduler.waiting)
        plan = schedule(*args, **kwargs)
        admitted.append(before - len(engine.scheduler.waiting))
        return plan

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    prompt = [(13 * i + 7) % 96 for i in range(14)]
    engine.generate([prompt], SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True))
    assert admitted[:2] == [1, 7]  # one sample per step before
    assert engine.stats.prefill_tokens == 14 + 7 * 2  # the others compute only the partial page


def test_a_weight_update_that_fails_part_way_stops_generation_until_a_whole_one() -> None:
    from miles.models.checkpoint import internal_to_hf

    new = tiny_model(seed=1)
    engine = Engine(tiny_model(seed=0), None, config())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    named = list(internal_to_hf(new.state_dict(), new.args))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(named[:-1] + [("model.norm.weight", torch.zeros(3))], version=5)
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="update_weights failed part-way"):
        engine.generate([[3, 14, 15, 92]], greedy)
    engine.update_weights(named, version=5)
    got = engine.generate([[3, 14, 15, 92]], greedy)[0]
    want = Engine(new, None, config()).generate([[3, 14, 15, 92]], greedy)[0]
    assert got.response_ids == want.response_ids and got.weight_version == 5


@pytest.mark.parametrize("key", ["max_running_requests", "max_batch_tokens"])
def test_a_zero_batch_limit_is_refused_at_start(key: str) -> None:
    with pytest.raises(ValueError, match=f"rollout.{key} must be >= 1"):
        Engine(tiny_model(), None, config(**{key: 0}))
