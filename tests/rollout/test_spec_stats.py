"""Speculative decoding is exact, checked statistically and against plain decoding.

With `rollout.speculative=ngram|draft|head` a verify step samples every row of a request's chunk (its last
token, then its drafts) with the uniform number plain decoding uses at that response position, and keeps the
samples up to the first that differs from its draft. So the kept tokens are the ones plain decoding draws,
whatever the drafts: the same seed gives the same tokens (bit for bit on CPU), and the distribution of
sequences is the model's. These tests check that, on a tiny model over an 8-token vocabulary:

- against a float64 reference written here from the definitions (logits of a full forward; temperature,
  top-k, top-p, min-p as `test_rollout_sampling_stats.reference_q` defines them): the joint distribution of
  the first three tokens (chi-square over every sequence of up to three tokens, a stop id ending some of
  them early), and every token of every sample (a randomized probability integral transform: under the
  model, F(token - 1) + w q(token), w uniform, is uniform on [0, 1) at every position, whatever came
  before); each test also checks that the same statistic rejects a neighbouring distribution (its power);
- every reported logprob equals the full forward's log q(token) to 1e-5, and greedy tokens are the argmax;
- the same seeds give the same tokens and statuses with and without speculation, for drafts from n-grams,
  a draft model (the model with a little noise on every weight: close, not equal, with a KV cache of its
  own) and a draft head (a head that reads the token embedding only: exact for the model's attention-free
  part, a "trained-like" head; for a model without attention it is perfect, and every draft is accepted);
- every path of verification runs and is counted: a draft rejected at each row, all drafts accepted (with
  the bonus row), a stop id accepted as a draft with more drafts after it, max_new_tokens reached at the end
  of an accepted run; with drafts injected (the target's own next tokens up to a chosen row, then a token the
  filters drop) each step keeps exactly the injected prefix, and filtered-out drafts are never accepted;
- without shared random numbers (the drafts drawn with other uniform numbers) the samples are the same.

The runs are seeded: the statistics are fixed numbers, and the thresholds leave a wide margin.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from miles.config import RolloutConfig
from miles.models import CausalLM
from miles.models.draft_head import DraftHead, new_draft_head
from miles.rollout import Engine, EngineStats, SamplingParams
from miles.rollout.spec import draws, head
from miles.rollout.spec.decoder import SpecDecoder
from miles.sample import Sample, SampleStatus
from tests.rollout.test_sampling_stats import chi_square_p, reference_q
from tests.support.models import assert_pool_clean, rollout_config, tiny_model

V = 8
"""Vocabulary size: small enough that every three-token sequence is a chi-square cell."""
STOP = 7
"""A stop id: requests end on it, inside draft runs too."""
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
"""Repeats itself, so that n-grams propose drafts."""
N = 4000
"""Samples per setting (one group: each sample's seed mixes in its index)."""
NEW_TOKENS = 8
K = 4
"""spec_draft_tokens."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(**overrides: object) -> RolloutConfig:
    return rollout_config(
        dict(kv_cache_bytes=64 * 1024 * 1024, max_batch_tokens=4096, max_running_requests=512),
        {"overlap_schedule": "off", **overrides},
    )


def make_model(attention: float, seed: int = 5) -> CausalLM:
    """A tiny model whose MLPs add nothing, with its attention output scaled by `attention` (0: the next
    token depends on the last token only)."""
    model = tiny_model(False, seed=seed, vocab_size=V, max_position_embeddings=64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention)
            layer.mlp.down_proj.weight.zero_()
    return model


MODEL = make_model(0.1)
"""The target: its attention matters (a little), so the context does."""


def noisy_copy(model: CausalLM, scale: float) -> CausalLM:
    """The model with every weight moved by a little noise: a draft model close to it, not equal."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return draft


def token_head(model: CausalLM) -> DraftHead:
    """A head that passes the last token's embedding through the model's final norm: for a model without
    attention it computes exactly the model's next-token logits (a perfectly trained head), for `MODEL` it
    is close to them, as a trained head would be."""
    head = new_draft_head(model.args, 0, model.dtype, model.device, seed=1)
    h = model.args.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.diag(model.model.norm.weight)
        head.mlp.down_proj.weight.zero_()
    return head.eval()


# The reference ---------------------------------------------------------------------------------------


def reference_rows(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """`reference_q` over rows [M, V] at once (float64): temperature, top-k with ties, top-p over the top-k
    mass keeping a token while the strictly more likely ones hold less than top_p, min-p relative to the most
    likely token; temperature 0 is the argmax with probability 1."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        q = np.zeros_like(z)
        q[np.arange(len(z)), z.argmax(-1)] = 1.0
        return q
    z = z / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.ones(z.shape, dtype=bool)
    if 0 < top_k < z.shape[-1]:
        keep &= z >= np.sort(z, -1)[:, ::-1][:, top_k - 1 : top_k]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum(-1, keepdims=True)
        above = (q[:, None, :] * (q[:, None, :] > q[:, :, None])).sum(-1)  # [m, t]: mass strictly above t
        keep &= above < top_p
    if min_p > 0.0:
        keep &= p >= min_p * p.max(-1, keepdims=True)
    q = np.where(keep, p, 0.0)
    return q / q.sum(-1, keepdims=True)


class BatchedCausal:
    """Causal attention over a batch of equal-length sequences (one SDPA call, where `VarlenAttention` runs
    one a sequence): the model's full forward for many sequences at once."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch, self.length = batch, length

    def kv_write(self, layer_idx: int) -> None:
        return None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        b, n = self.batch, self.length
        q, k, v = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[3])


def forward_logits(model: CausalLM, sequences: list[list[int]]) -> np.ndarray:
    """[len(sequences), longest, V] float32 logits of full forwards (right-padded: causal, so the padding
    changes no earlier row)."""
    longest = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in sequences])
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), 1024):
            batch = ids[i : i + 1024]
            positions = torch.arange(longest).repeat(len(batch))
            hidden = model.forward_packed(
                batch.reshape(-1), positions, BatchedCausal(len(batch), longest)
            ).hidden
            out.append(model.compute_logits(hidden).view(len(batch), longest, -1))
    return torch.cat(out).float().numpy()


def response_logits(model: CausalLM, samples: list[Sample]) -> list[np.ndarray]:
    """Each sample's [len(response), V] logits, row i the one its response token i was drawn from."""
    logits = forward_logits(model, [s.prompt_ids + s.response_ids for s in samples])
    return [
        rows[len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
        for rows, s in zip(logits, samples)
    ]


def first_tokens_reference(model: CausalLM, setting: tuple[float, int, float, float]) -> dict[tuple, float]:
    """P(the response starts with each sequence of three tokens, or of fewer ending in STOP), float64."""
    pairs = [[a, b] for a in range(V) for b in range(V)]
    logits = forward_logits(model, [PROMPT + pair for pair in pairs])[:, len(PROMPT) - 1 :]
    q = reference_rows(logits.reshape(-1, V), *setting).reshape(len(pairs), 3, V)
    probs: dict[tuple, float] = {}
    for (a, b), rows in zip(pairs, q):
        if b == 0:
            if a == STOP:
                probs[(a,)] = rows[0, a]
            else:
                probs[(a, STOP)] = rows[0, a] * rows[1, STOP]
        if STOP in (a, b):
            continue
        for c in range(V):
            probs[(a, b, c)] = rows[0, a] * rows[1, b] * rows[2, c]
    return probs


def pooled_chi_square(observed: Counter, probs: dict[tuple, float], total: int) -> float:
    """Pearson's p-value over the cells, those expecting fewer than 5 pooled into one (the cells holding
    every outcome of probability > 0: an outcome outside them fails the caller's own check)."""
    cells = sorted(probs, key=lambda c: probs[c])
    small = [c for c in cells if probs[c] * total < 5]
    big = [c for c in cells if probs[c] * total >= 5]
    counts = [observed.get(c, 0) for c in big] + [sum(observed.get(c, 0) for c in small)]
    expected = [probs[c] for c in big] + [sum(probs[c] for c in small)]
    keep = [i for i, e in enumerate(expected) if e > 0]
    return chi_square_p(np.asarray(counts)[keep], np.asarray(expected)[keep])


def first_tokens(samples: list[Sample]) -> Counter:
    out = Counter()
    for s in samples:
        head = tuple(s.response_ids[:3])
        if STOP in head:
            head = head[: head.index(STOP) + 1]
        out[head] += 1
    return out


def pit_p_value(samples: list[Sample], logits: list[np.ndarray], setting: tuple, bins: int = 20) -> float:
    """Randomized PIT of every response token under `setting`'s distribution of its row (the tokens ordered
    from the most likely), chi-square against uniform; 0 if any token has probability 0 there."""
    rows = np.concatenate(logits)
    tokens = np.concatenate([s.response_ids for s in samples])
    q = reference_rows(rows, *setting)
    at = np.arange(len(tokens))
    chosen = q[at, tokens]
    if (chosen <= 0).any():
        return 0.0
    # The mass of the tokens before it with the most likely first (any order fixed by the row is uniform
    # under the model; this one makes a temperature off move the values to one end).
    order = np.argsort(-q, axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1)
    below = np.take_along_axis(np.cumsum(np.take_along_axis(q, order, -1), -1), rank, -1) - q
    w = np.random.default_rng(0).random(len(tokens))
    u = below[at, tokens] + w * chosen
    counts = np.bincount(np.minimum((u * bins).astype(int), bins - 1), minlength=bins)
    return chi_square_p(counts, np.full(bins, 1.0 / bins))


def test_the_vectorised_reference_is_reference_q() -> None:
    rows = np.random.default_rng(3).normal(size=(40, V)) * 2
    rows[:, 5] = rows[:, 2]  # ties at filter boundaries
    for setting in [(1.0, -1, 1.0, 0.0), (0.7, 3, 0.8, 0.1), (1.3, -1, 0.6, 0.0), (0.9, 5, 1.0, 0.3)]:
        want = np.stack([reference_q(r, *setting) for r in rows])
        np.testing.assert_allclose(reference_rows(rows, *setting), want, rtol=1e-12, atol=1e-15)


# The runs --------------------------------------------------------------------------------------------


class VerifyLog:
    """What each verify step kept (SpecDecoder.accept wrapped): (drafts, kept tokens, status, whether the output
    reached max_new_tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[tuple[int, ...], list[int], SampleStatus | None, bool]] = []
        self.where: list[tuple[int, int]] = []
        """(request index in its group, output length before the step) of each step."""
        original = SpecDecoder.accept

        def accept(spec, req, draft, tokens, logprobs, cuts, stats):  # noqa: ANN001, ANN202
            before = len(req.output_ids) - 1  # the placeholder goes
            status = original(spec, req, draft, tokens, logprobs, cuts, stats)
            at_limit = len(req.output_ids) == req.params.max_new_tokens
            self.steps.append((tuple(draft), req.output_ids[before:], status, at_limit))
            self.where.append((req.index, before))
            return status

        monkeypatch.setattr(SpecDecoder, "accept", accept)

    def events(self) -> Counter:
        """Counts of each path: `rejected@j` (the sample of row j differs from its draft), `all_accepted`
        (the bonus row's sample kept too), `stop_on_accepted_draft` (an accepted draft is a stop id with more
        drafts after it, left unverified), `stop_on_row`, `max_new_tokens_at_run_end`."""
        out = Counter()
        for draft, kept, status, at_limit in self.steps:
            n = len(kept)
            matched = n <= len(draft) and kept[-1] == draft[n - 1]
            if n == len(draft) + 1:
                out["all_accepted"] += 1
            elif not matched:
                out[f"rejected@{n - 1}"] += 1
            if status == SampleStatus.COMPLETED:
                out["stop_on_accepted_draft" if matched else "stop_on_row"] += 1
            if status == SampleStatus.TRUNCATED and at_limit and n == len(draft) + 1:
                out["max_new_tokens_at_run_end"] += 1
        return out


def make_engine(**spec: object) -> Engine:
    """An engine for MODEL; `spec` holds config overrides and the `draft_model` / `draft_head` to use."""
    drafts = {k: spec.pop(k) for k in ("draft_model", "draft_head") if k in spec}
    return Engine(MODEL, None, config(**spec), **drafts)  # type: ignore[arg-type]


def generate(
    params: SamplingParams, prompts: list[list[int]] | None = None, **spec: object
) -> tuple[list[Sample], Engine]:
    engine = make_engine(**spec)
    samples = engine.generate(prompts or [PROMPT], params)
    assert_pool_clean(engine)
    return samples, engine


SPEC = {
    "ngram": lambda: dict(speculative="ngram"),
    "draft": lambda: dict(speculative="draft", draft_model=noisy_copy(MODEL, 0.005)),
    "head": lambda: dict(speculative="head", draft_head=token_head(MODEL)),
}

SETTINGS = {
    "t1": (1.0, -1, 1.0, 0.0),
    "t0.7_top_p": (0.7, -1, 0.8, 0.0),
    "t1.3_top_k": (1.3, 3, 1.0, 0.0),
    "t1_min_p": (1.0, -1, 1.0, 0.15),
    "t0.8_all_filters": (0.8, 5, 0.9, 0.05),
}


def assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.status for s in got] == [s.status for s in want]
    lp = max(
        float(np.abs(np.subtract(a.rollout_logprobs, b.rollout_logprobs)).max()) for a, b in zip(got, want)
    )
    assert lp <= 1e-5, lp


def assert_logprobs_are_the_full_forwards(
    samples: list[Sample], logits: list[np.ndarray], setting: tuple
) -> None:
    temperature = setting[0]
    worst = 0.0
    for s, rows in zip(samples, logits):
        tokens = np.asarray(s.response_ids)
        if temperature == 0.0:  # greedy's convention: the temperature-1 log-softmax
            z = rows.astype(np.float64)
            logq = z - z.max(-1, keepdims=True)
            logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
        else:
            with np.errstate(divide="ignore"):
                logq = np.log(reference_rows(rows, *setting))
        want = logq[np.arange(len(tokens)), tokens]
        assert np.isfinite(want).all(), "a token the filters drop was drawn"
        worst = max(worst, float(np.abs(np.asarray(s.rollout_logprobs) - want).max()))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculation_draws_the_models_distribution(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 4000 samples of 8 tokens (stop id 7) with each kind of draft: the same tokens as plain decoding's,
    the first three tokens' joint distribution and every token's PIT fit the float64 reference (and reject
    a temperature 25 % off), logprobs are the full forward's, and rejections at every row were verified."""
    values = SETTINGS[setting]
    params = SamplingParams(
        n=N,
        temperature=values[0],
        top_k=values[1],
        top_p=values[2],
        min_p=values[3],
        max_new_tokens=NEW_TOKENS,
        seed=17,
        stop_token_ids=[STOP],
    )
    plain, _ = generate(params)
    logits = response_logits(MODEL, plain)
    assert_logprobs_are_the_full_forwards(plain, logits, values)
    probs = first_tokens_reference(MODEL, values)
    off = (values[0] * 1.25, *values[1:])
    counts = first_tokens(plain)
    assert set(counts) <= {c for c, p in probs.items() if p > 0}
    assert pooled_chi_square(counts, probs, N) > 1e-3
    assert pooled_chi_square(counts, first_tokens_reference(MODEL, off), N) < 1e-6  # power
    assert pit_p_value(plain, logits, values) > 1e-3
    assert pit_p_value(plain, logits, off) < 1e-6  # power
    log = VerifyLog(monkeypatch)
    total = Counter()
    for kind, spec in SPEC.items():
        log.steps.clear()
        log.where.clear()
        got, engine = generate(params, spec_draft_tokens=K, **spec())
        assert_same_samples(got, plain)
        # Checked on the speculative samples themselves (the same tokens; logprobs of other batches).
        assert pooled_chi_square(first_tokens(got), probs, N) > 1e-3
        assert_logprobs_are_the_full_forwards(got, logits, values)
        events = log.events()
        m = engine.metrics()
        assert m["rollout/spec_steps"] == len(log.steps) > N / 4, (kind, m)
        assert events["rejected@0"] > 0 and events["all_accepted"] > 0, (kind, events)
        total.update(events)
    for path in [f"rejected@{j}" for j in range(K)] + [
        "all_accepted",
        "stop_on_accepted_draft",
        "stop_on_row",
        "max_new_tokens_at_run_end",
    ]:
        assert total[path] > 0, (path, total)


def test_greedy_speculation_takes_the_argmax() -> None:
    """Greedy: every token is the argmax of the full forward's logits (no near ties here) with its
    temperature-1 logprob, and the speculative runs give the very same samples."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[STOP])
    prompts = [PROMPT, [4, 4, 4, 4], [6, 5, 4, 3, 2, 1], [0, 3, 6, 1, 4, 7, 2, 5]]
    plain, _ = generate(params, prompts)
    logits = response_logits(MODEL, plain)
    for s, rows in zip(plain, logits):
        top2 = np.sort(rows, -1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-4).all()
        assert s.response_ids == rows.argmax(-1).tolist()
    assert_logprobs_are_the_full_forwards(plain, logits, (0.0, -1, 1.0, 0.0))
    for kind, spec in SPEC.items():
        got, engine = generate(params, prompts, spec_draft_tokens=K, **spec())
        assert_same_samples(got, plain)
        assert engine.metrics()["rollout/spec_accepted_tokens"] > 0, kind


@pytest.mark.parametrize("setting", ["greedy", "t1.3_top_k", "t0.8_all_filters"])
def test_injected_drafts_keep_exactly_their_matching_prefix(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts replaced before each verify step by plain decoding's own next tokens up to a random row, then
    tokens the filters drop there (the greedy argmax's losers): every step keeps exactly the drafts that are
    plain decoding's tokens, up to its stop id or max_new_tokens, plus one sample; no dropped token is ever
    accepted, and the samples are plain decoding's."""
    values = (0.0, -1, 1.0, 0.0) if setting == "greedy" else SETTINGS[setting]
    params = SamplingParams(
        n=1000,
        temperature=values[0],
        top_k=values[1],
        top_p=values[2],
        min_p=values[3],
        max_new_tokens=12,
        seed=5,
        stop_token_ids=[STOP],
    )
    plain, _ = generate(params)
    logits = response_logits(MODEL, plain)
    responses = {s.index: (s.response_ids, reference_rows(rows, *values)) for s, rows in zip(plain, logits)}
    rng = random.Random(0)
    planned: dict[tuple[int, int], int] = {}
    """(index, output length) -> drafts that are plain decoding's next tokens."""
    propose = SpecDecoder.propose

    def injected(spec: SpecDecoder, stats: EngineStats, alternatives: bool) -> None:
        propose(spec, stats, alternatives)
        for req in spec.scheduler.running:
            if not req.draft:
                continue
            response, q = responses[req.index]
            at, k = len(req.output_ids), len(req.draft)
            future = response[at : at + k]
            right = min(rng.randrange(k + 1), len(future))
            draft = future[:right]
            for j in range(right, k):
                if j < len(future):  # a token the filters drop at that position
                    draft.append(int(rng.choice(np.flatnonzero(q[at + j] == 0))))
                else:  # past the end of plain decoding's response
                    draft.append(rng.randrange(V))
            req.draft = draft
            planned[(req.index, at)] = right

    monkeypatch.setattr(SpecDecoder, "propose", injected)
    log = VerifyLog(monkeypatch)
    got, engine = generate(params, speculative="head", spec_draft_tokens=K, draft_head=token_head(MODEL))
    assert_same_samples(got, plain)
    accepted = Counter()
    for (draft, kept, _, _), where in zip(log.steps, log.where):
        right = planned[where]
        ended = len(kept) <= len(draft) and kept[-1] == draft[len(kept) - 1]  # a stop id among the drafts
        assert len(kept) == right + 1 or (ended and len(kept) <= right), (draft, kept, right)
        accepted[len(kept) - 1] += 1
    assert len(log.steps) == len(planned) == engine.metrics()["rollout/spec_steps"] > 1000
    assert set(accepted) == set(range(K + 1)), accepted  # every number of accepted drafts, 0 to K


@pytest.mark.parametrize("kind", ["draft", "head"])
def test_the_samples_do_not_depend_on_the_drafts_random_numbers(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts drawn with plain decoding's uniform numbers are accepted far more often than drafts drawn with
    other ones (that is all the sharing buys); the samples are plain decoding's either way, at temperature 1
    and with filters."""
    params = SamplingParams(
        n=500, temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=12, seed=9, stop_token_ids=[STOP]
    )
    plain, _ = generate(params)
    rates = []
    for shifted in (False, True):
        if shifted:
            for module in (draws, head):
                shared = module.uniforms_of_mixed
                monkeypatch.setattr(
                    module,
                    "uniforms_of_mixed",
                    lambda mixed, positions, f=shared: (f(mixed, positions) + 0.5) % 1.0,
                )
        got, engine = generate(params, spec_draft_tokens=K, **SPEC[kind]())
        assert_same_samples(got, plain)
        m = engine.metrics()
        rates.append(m["rollout/spec_accepted_tokens"] / m["rollout/spec_draft_tokens"])
    coupled, independent = rates
    assert coupled > 0.3 and independent < 0.5 * coupled, rates


def test_a_perfect_head_has_every_draft_accepted() -> None:
    """For a model whose next token depends on the last token only, `token_head` computes the model's own
    logits: with shared random numbers its draws are the very tokens plain decoding then samples, at any
    temperature and under every filter (where independent draws would agree at the rate of a collision)."""
    model = make_model(0.0)
    for values in [
        (1.0, -1, 1.0, 0.0),
        (0.7, -1, 0.8, 0.0),
        (1.3, 3, 1.0, 0.0),
        (1.0, -1, 1.0, 0.15),
        (0.0, -1, 1.0, 0.0),
    ]:
        params = SamplingParams(
            n=200,
            temperature=values[0],
            top_k=values[1],
            top_p=values[2],
            min_p=values[3],
            max_new_tokens=12,
            seed=1,
        )
        plain = Engine(model, None, config()).generate([PROMPT], params)
        engine = Engine(
            model, None, config(speculative="head", spec_draft_tokens=K), draft_head=token_head(model)
        )
        assert_same_samples(engine.generate([PROMPT], params), plain)
        m = engine.metrics()
        assert m["rollout/spec_accepted_tokens"] == m["rollout/spec_draft_tokens"] > 0, (values, m)
        assert m["rollout/spec_accept_length"] == K + 1


MIXED = [
    SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[STOP]),
    SamplingParams(temperature=1.0, max_new_tokens=17, seed=3),
    SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=20, seed=4, stop_token_ids=[STOP]),
    SamplingParams(temperature=1.3, top_k=3, max_new_tokens=9, stop_token_ids=[STOP, 0]),
    SamplingParams(temperature=1.0, min_p=0.15, top_k=5, max_new_tokens=20, seed=6, stop_token_ids=[STOP]),
]


@pytest.mark.parametrize("kind", list(SPEC))
@pytest.mark.parametrize("loop", ["plain_loop", "gated_overlap"])
def test_mixed_settings_in_one_batch_give_plain_decodings_samples(kind: str, loop: str) -> None:
    """Requests with different settings (greedy, temperatures, filters, seeded or not, stop ids, limits) in
    the same steps, 8 samples each, under preemption in a small pool and chunked prefill; with the speculation
    gate closing and probing while plain steps are overlap-scheduled too: every sample is plain decoding's."""
    prompts = [PROMPT, [4, 4, 4, 4], [6, 5, 4, 3, 2, 1], [0, 3, 6, 1, 4, 7, 2, 5] * 2, [2]]
    cfg = dict(kv_cache_bytes=(120 + 1) * 512, max_batch_tokens=24, max_running_requests=16)

    def run(**spec: object) -> tuple[list[Sample], Engine]:
        engine = make_engine(**cfg, **spec)
        rids = [
            engine.add_request(prompt, params, group_id=g, index=i)
            for g, (prompt, params) in enumerate(zip(prompts, MIXED))
            for i in range(8)
        ]
        while engine.has_unfinished:
            engine.step()
        assert_pool_clean(engine)
        return [engine.take_result(r) for r in rids], engine

    plain, engine = run()
    assert engine.metrics()["rollout/preemptions"] > 0, "the small pool was meant to preempt"
    spec = SPEC[kind]()
    if loop == "gated_overlap":
        spec.update(overlap_schedule="on", spec_min_accept_length=2.5, spec_probe_every=2)
    got, engine = run(spec_draft_tokens=3, **spec)
    assert_same_samples(got, plain)
    m = engine.metrics()
    assert m["rollout/spec_steps"] > 0 and m["rollout/spec_accepted_tokens"] > 0
    if loop == "gated_overlap":
        assert m["rollout/spec_gated_steps"] > 0
