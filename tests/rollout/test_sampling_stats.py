"""The sampler against independent float64 reference definitions, checked statistically.

The reference (`reference_q`) is written here from the definitions, not from the sampler's helpers: logits / T,
then top-k (every token at least as likely as the k-th, ties included: transformers' `TopKLogitsWarper`,
vLLM), then top-p on the renormalised top-k distribution (keep a token when the tokens strictly more likely
hold less than top_p of the mass: the smallest nucleus reaching top_p, with a tie at its boundary kept
whole, as FlashInfer's top-p sampling keeps it), then min-p relative to the most likely token after
temperature (transformers' `MinPLogitsWarper`, last in transformers' order). Draws use fixed seeds, so every
test is deterministic; the thresholds leave room for float32 rounding only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.rollout.sampling.sampler import (
    SamplingTensors,
    filtered_logprobs,
    sample,
    top_alternatives,
    uniforms,
)


def reference_q(
    logits: np.ndarray | torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The distribution sampled from, in float64. temperature 0 is greedy: the argmax with probability 1."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        q = np.zeros_like(z)
        q[int(np.argmax(z))] = 1.0
        return q
    z = z / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(z.shape, dtype=bool)
    if 0 < top_k < z.size:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        above = np.array([q[q > q[t]].sum() for t in range(z.size)])
        keep &= above < top_p
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of `counts` against `probs` (over the tokens with probability > 0)."""
    expected = torch.as_tensor(probs * counts.sum(), dtype=torch.float64)
    observed = torch.as_tensor(counts, dtype=torch.float64)
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def settings(
    rows: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed0: int = 0
) -> SamplingTensors:
    return SamplingTensors.build(
        [temperature] * rows,
        [top_k] * rows,
        [top_p] * rows,
        [min_p] * rows,
        uniforms(np.arange(seed0, seed0 + rows), np.full(rows, 3)),
        vocab,
        torch.device("cpu"),
    )


def draw(
    logits: torch.Tensor,
    draws: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed0: int = 1,
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """(counts per token, tokens, logprobs) of `draws` draws from one logits row (one seed per draw)."""
    vocab = logits.shape[-1]
    st = settings(draws, vocab, temperature, top_k, top_p, min_p, seed0)
    tokens, logprobs = sample(logits.expand(draws, vocab).contiguous(), st)
    return np.bincount(tokens.numpy(), minlength=vocab), tokens, logprobs


def check_draws(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    q = reference_q(logits, temperature, top_k, top_p, min_p)
    counts, tokens, logprobs = draw(logits, 40_000, temperature, top_k, top_p, min_p)
    assert counts[q == 0].sum() == 0, f"drew tokens the definition drops: {np.nonzero(counts * (q == 0))}"
    kept = q > 0
    assert chi_square_p(counts[kept], q[kept]) > 1e-6, (counts, np.round(q * 40_000))
    # Each returned logprob is log q(token) of that same distribution.
    np.testing.assert_allclose(logprobs.double().numpy(), np.log(q[tokens.numpy()]), atol=2e-5, rtol=0)


LOGITS = torch.randn(24, generator=torch.Generator().manual_seed(20)) * 1.7

CASES = [
    (1.0, -1, 1.0, 0.0),
    (0.6, -1, 1.0, 0.0),
    (1.8, -1, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0),
    (0.8, -1, 0.7, 0.0),
    (1.3, -1, 1.0, 0.1),
    (0.9, 8, 0.85, 0.0),
    (1.2, 10, 0.9, 0.05),
    (0.7, -1, 0.95, 0.2),
    (2.0, 12, 0.8, 0.3),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CASES)
def test_draws_and_logprobs_follow_the_reference(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    check_draws(LOGITS, temperature, top_k, top_p, min_p)


def test_the_chi_square_rejects_a_sampler_one_step_off() -> None:
    """Power: the draws of one setting tested against the neighbouring definitions are rejected."""
    counts, _, _ = draw(LOGITS, 40_000, 1.0, -1, 1.0, 0.0)
    assert chi_square_p(counts, reference_q(LOGITS, 1.1, -1, 1.0, 0.0)) < 1e-6
    counts, _, _ = draw(LOGITS, 40_000, 0.8, -1, 0.7, 0.0)
    q = reference_q(LOGITS, 0.8, -1, 0.7, 0.0)
    wider = reference_q(LOGITS, 0.8, -1, 0.8, 0.0)
    assert (wider > 0).sum() > (q > 0).sum()
    assert counts[(wider > 0) & (q == 0)].sum() == 0  # the extra tokens were never drawn


def test_min_p_is_relative_to_the_most_likely_token_after_temperature() -> None:
    # At T = 2 the distribution flattens: min_p = 0.3 keeps the tokens whose p_T >= 0.3 max p_T, more than
    # the same rule on the temperature-1 probabilities would keep.
    logits = torch.tensor([3.0, 2.0, 1.2, 0.6, 0.0, -1.0])
    q = reference_q(logits, 2.0, -1, 1.0, 0.3)
    at_one = reference_q(logits, 1.0, -1, 1.0, 0.3)
    assert (q > 0).sum() == 4 and (at_one > 0).sum() == 2
    check_draws(logits, 2.0, -1, 1.0, 0.3)


def test_min_p_comes_after_top_p_as_in_transformers() -> None:
    # p = [0.5, 0.3, 0.2]: top_p = 0.6 keeps {0, 1}; min_p = 0.5 then keeps both (0.3 >= 0.25). Applied first
    # (vLLM's order), min-p would renormalise to [0.625, 0.375] and top-p would keep token 0 alone.
    logits = torch.tensor(np.log([0.5, 0.3, 0.2]), dtype=torch.float32)
    q = reference_q(logits, 1.0, -1, 0.6, 0.5)
    np.testing.assert_allclose(q, [0.625, 0.375, 0.0])
    check_draws(logits, 1.0, -1, 0.6, 0.5)


TIES = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5, 0.5, -1.0, 1.0, -3.0])
"""Token 0, then four tokens tied at 1.0 (ids 1, 2, 3, 7), two at 0.5, two below."""


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 2, 1.0, 0.0),  # the k-th most likely is tied with three more: all four kept
        (1.0, 5, 1.0, 0.0),
        (0.7, 3, 1.0, 0.0),
        (1.0, -1, 0.5, 0.0),  # the nucleus reaches 0.5 inside the tie: the whole tie is kept
        (1.3, -1, 0.75, 0.0),
        (1.0, 6, 0.9, 0.0),
    ],
)
def test_ties_at_a_filter_boundary_are_kept_together(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    """Tokens with equal logits are equally likely under any filter: whether a tie at the boundary of top-k
    or top-p survives cannot depend on the tokens' ids (or on how a sort orders equal keys)."""
    q = reference_q(TIES, temperature, top_k, top_p, min_p)
    assert len({round(float(q[i]), 12) for i in (1, 2, 3, 7)}) == 1 and q[1] > 0
    check_draws(TIES, temperature, top_k, top_p, min_p)
    logq, ids = filtered_logprobs(
        TIES[None],
        torch.tensor([temperature]),
        torch.tensor([top_k if top_k > 0 else TIES.numel()]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    by_token = torch.full((TIES.numel(),), float("-inf"))
    by_token[ids[0]] = logq[0]
    np.testing.assert_allclose(by_token.exp().double().numpy(), q, atol=1e-6)


def test_greedy_is_the_argmax_with_its_temperature_one_logprob() -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(9)) * 2
    temperature = [0.0 if i % 2 == 0 else 0.9 for i in range(64)]
    for top_k, top_p, min_p in [(-1, 1.0, 0.0), (3, 0.5, 0.1)]:
        st = SamplingTensors.build(
            temperature,
            [top_k] * 64,
            [top_p] * 64,
            [min_p] * 64,
            uniforms(np.arange(64), np.zeros(64)),
            30,
            torch.device("cpu"),
        )
        tokens, logprobs = sample(logits, st)
        greedy = torch.arange(64) % 2 == 0
        assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
        expected = torch.log_softmax(logits[greedy].double(), -1).max(-1).values
        torch.testing.assert_close(logprobs[greedy].double(), expected, atol=1e-6, rtol=0)


def test_a_row_draws_the_same_whatever_the_other_rows_filter() -> None:
    """A request's token and logprob depend on its logits, its settings and its uniform number only: not on
    whether another request of the step uses top-k / top-p / min-p (nor greedy), bit for bit."""
    vocab, rows = 3000, 48
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 2.5
    own = [(1.0, -1, 1.0, 0.0), (0.7, -1, 1.0, 0.0), (0.9, 20, 1.0, 0.0), (1.1, -1, 0.9, 0.05)]
    other = [(1.0, 5, 0.8, 0.0), (0.0, -1, 1.0, 0.0), (0.8, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.3)]
    u = uniforms(np.arange(rows), np.full(rows, 7))

    def run(mix: list[tuple[float, int, float, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        t, k, p, m = (list(c) for c in zip(*(mix[i % len(mix)] for i in range(rows))))
        return sample(logits, SamplingTensors.build(t, k, p, m, u, vocab, torch.device("cpu")))

    for setting in own:
        alone = run([setting])
        for neighbour in other:
            tokens, logprobs = run([setting, neighbour])
            assert torch.equal(tokens[::2], alone[0][::2]), (setting, neighbour)
            assert torch.equal(logprobs[::2], alone[1][::2]), (setting, neighbour)


def test_top_p_of_one_keeps_the_whole_vocabulary() -> None:
    # The float32 cumulative mass of a 152k vocabulary reaches 1 before its last tokens: top_p = 1 (off)
    # must still keep them (their probability is small, not 0).
    vocab = 151_936
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    one = torch.ones(1)
    logq, _ = filtered_logprobs(logits, one, torch.tensor([vocab]), one, torch.zeros(1))
    assert torch.isfinite(logq).all()
    logq, _ = filtered_logprobs(logits, one, torch.tensor([50]), one, torch.zeros(1))
    assert int(torch.isfinite(logq).sum()) == 50


def test_alternatives_follow_the_reference() -> None:
    """`top_alternatives` (Sample.top_logprobs): the most likely tokens under the distribution sampled from."""
    for temperature, top_k, top_p, min_p in [(1.0, 2, 1.0, 0.0), (1.0, -1, 0.5, 0.0), (0.0, 2, 0.5, 0.0)]:
        st = settings(1, TIES.numel(), temperature, top_k, top_p, min_p)
        ids, values = top_alternatives(TIES[None], st, 6)
        q = reference_q(
            TIES,
            temperature if temperature > 0 else 1.0,
            *((top_k, top_p, min_p) if temperature > 0 else (-1, 1.0, 0.0)),
        )
        np.testing.assert_allclose(values[0].exp().double().numpy(), q[ids[0].numpy()], atol=1e-6)
        assert sorted(q[ids[0].numpy()].tolist(), reverse=True) == q[ids[0].numpy()].tolist()


def test_rollout_logprobs_are_what_the_trainer_recomputes() -> None:
    """Unfiltered rows: the engine's logprob is the trainer's log softmax(logits / T) of the token
    (trainer/logprobs.py), so the loop's importance ratios start at 1. Filtered rows: it is the renormalised
    one, log p_T(token) - log(mass kept), which the trainer does not recompute (docs/algorithms.md)."""
    from miles.trainer.logprobs import chunked_logprobs

    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(256, 32, generator=gen), torch.randn(500, 32, generator=gen) * 0.3
    logits = hidden @ weight.T
    for temperature in (1.0, 0.7):
        tokens, logprobs = sample(logits, settings(256, 500, temperature, -1, 1.0, 0.0))
        trainer, _ = chunked_logprobs(hidden, weight, tokens, temperature)
        torch.testing.assert_close(logprobs, trainer, atol=1e-5, rtol=0)
        tokens, logprobs = sample(logits, settings(256, 500, temperature, 40, 0.9, 0.0))
        trainer, _ = chunked_logprobs(hidden, weight, tokens, temperature)
        kept = torch.tensor(
            [
                reference_q(row, temperature, -1, 1.0, 0.0)[
                    reference_q(row, temperature, 40, 0.9, 0.0) > 0
                ].sum()
                for row in logits
            ]
        )
        torch.testing.assert_close(logprobs.double(), trainer.double() - kept.log(), atol=2e-5, rtol=0)


def test_seeds_reproduce_and_positions_decorrelate() -> None:
    logits = LOGITS.expand(4, -1)
    st = SamplingTensors.build(
        [1.0] * 4,
        [-1] * 4,
        [1.0] * 4,
        [0.0] * 4,
        uniforms([11, 11, 12, 11], [0, 0, 0, 1]),
        24,
        torch.device("cpu"),
    )
    a, _ = sample(logits, st)
    b, _ = sample(logits, st)
    assert torch.equal(a, b) and a[0] == a[1]
    # Over many positions of one seed the draws follow the distribution too (no correlation along a sequence).
    positions = np.arange(40_000)
    st = SamplingTensors.build(
        [1.0] * 40_000,
        [-1] * 40_000,
        [1.0] * 40_000,
        [0.0] * 40_000,
        uniforms([7] * 40_000, positions),
        24,
        torch.device("cpu"),
    )
    tokens, _ = sample(LOGITS.expand(40_000, -1).contiguous(), st)
    counts = np.bincount(tokens.numpy(), minlength=24)
    assert chi_square_p(counts, reference_q(LOGITS, 1.0, -1, 1.0, 0.0)) > 1e-6


@pytest.mark.parametrize("top_p", [0.9, 0.99, 0.9999])
def test_the_nucleus_of_a_large_vocabulary_reaches_top_p(top_p: float) -> None:
    """Over 152k tokens a float32 running sum of the probabilities falls short of their mass by ~1e-5: the
    nucleus must still be the smallest set of most likely tokens whose (float64) mass reaches top_p."""
    vocab = 151_936
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logq, ids = filtered_logprobs(
        logits, torch.ones(1), torch.tensor([vocab]), torch.tensor([top_p]), torch.zeros(1)
    )
    kept = int(torch.isfinite(logq).sum())
    p = torch.softmax(logits[0].double(), -1).sort(descending=True).values
    reference = int((p.cumsum(0) - p < top_p).sum())
    assert abs(kept - reference) <= 2, (kept, reference)
    assert float(p[:kept].sum()) >= top_p - 1e-6


@pytest.mark.parametrize("top_k,top_p,min_p", [(1500, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.04)])
def test_filtered_draws_across_cdf_blocks_follow_the_reference(
    top_k: int, top_p: float, min_p: float
) -> None:
    """A filtered row of several 1024-token blocks (the two-level inverse CDF over weights with the dropped
    tokens at 0): heavy tokens counted one by one, the light kept ones per block."""
    vocab, draws = 3000, 6_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(12)) * 0.5
    heavy = torch.tensor([3, 700, 1023, 1024, 1500, 2047, 2048, 2999])
    logits[heavy] += torch.linspace(2.0, 3.5, len(heavy))
    q = reference_q(logits, 1.0, top_k, top_p, min_p)
    assert 0 < (q > 0).sum() < vocab - 100  # the filter drops a good part of the vocabulary
    counts, tokens, logprobs = draw(logits, draws, 1.0, top_k, top_p, min_p)
    assert counts[q == 0].sum() == 0
    light = np.ones(vocab, dtype=bool)
    light[heavy.numpy()] = False
    groups = [np.isin(np.arange(vocab), heavy[i : i + 1].numpy()) for i in range(len(heavy))]
    groups += [light & (np.arange(vocab) // 1024 == b) for b in range(3)]
    observed = np.array([counts[g].sum() for g in groups])
    expected = np.array([q[g].sum() for g in groups])
    assert chi_square_p(observed, expected) > 1e-6, (observed, np.round(expected * draws))
    np.testing.assert_allclose(logprobs.double().numpy(), np.log(q[tokens.numpy()]), atol=2e-5, rtol=0)
