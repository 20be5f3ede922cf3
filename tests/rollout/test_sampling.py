"""Sampler: exact logprobs (against transformers' logits warpers), distribution (chi-square), seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.rollout.sampling.params import SamplingParams
from miles.rollout.sampling.sampler import SamplingTensors, _splitmix64, derive_seed, sample, uniforms
from tests.support.models import hf_logq


def chisquare(observed: object, expected: object) -> tuple[float, float]:
    """Pearson's chi-square statistic and its p-value (survival function of chi2 with k - 1 dof)."""
    observed, expected = torch.as_tensor(observed).double(), torch.as_tensor(expected).double()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(stat), float(torch.special.gammaincc(dof, stat / 2))


def tensors(
    rows: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed0: int = 0
) -> SamplingTensors:
    return SamplingTensors.build(
        [temperature] * rows,
        [top_k] * rows,
        [top_p] * rows,
        [min_p] * rows,
        uniforms(np.arange(seed0, seed0 + rows), np.zeros(rows)),
        vocab,
        torch.device("cpu"),
    )


SETTINGS = [
    (1.0, -1, 1.0, 0.0),
    (0.7, -1, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (0.8, -1, 0.6, 0.0),
    (1.0, 6, 0.8, 0.0),
    (0.9, -1, 1.0, 0.2),
    (1.2, 7, 0.9, 0.05),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_logprobs_are_those_of_the_renormalised_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen) * 2
    tokens, logprobs = sample(logits, tensors(64, 40, temperature, top_k, top_p, min_p))
    for row in range(64):
        ref = hf_logq(logits[row], temperature, top_k, top_p, min_p)
        assert torch.isfinite(ref[tokens[row]]), "sampled a token the warpers drop"
        assert abs(float(logprobs[row]) - float(ref[tokens[row]])) <= 1e-5


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [SETTINGS[0], SETTINGS[1], SETTINGS[4], SETTINGS[6]]
)
def test_draws_follow_the_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    tokens, _ = sample(
        logits.expand(draws, vocab), tensors(draws, vocab, temperature, top_k, top_p, min_p, seed0=99)
    )
    expected = hf_logq(logits, temperature, top_k, top_p, min_p).exp().double()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "drew a filtered-out token"
    keep = expected > 0
    f_exp = expected[keep] / expected[keep].sum() * draws
    _, p_value = chisquare(counts[keep].numpy(), f_exp.numpy())
    assert p_value > 1e-4, (counts, expected * draws)


def test_a_biased_sampler_would_fail_the_chi_square() -> None:
    # The statistical test has power: a sampler that drew from temperature 1.1 instead of 1.0 is rejected.
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    tokens, _ = sample(logits.expand(draws, vocab), tensors(draws, vocab, 1.1, -1, 1.0, 0.0, seed0=99))
    expected = torch.softmax(logits.double(), -1)
    _, p_value = chisquare(
        torch.bincount(tokens, minlength=vocab).double().numpy(), (expected * draws).numpy()
    )
    assert p_value < 1e-4


def test_greedy_rows_take_argmax_with_temperature_one_logprob() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    temps = [0.0, 1.0, 0.0, 0.5, 0.0, 1.0]
    st = SamplingTensors.build(
        temps,
        [-1, 5, 3, -1, -1, -1],
        [1.0, 0.9, 0.5, 1.0, 1.0, 1.0],
        [0.0] * 6,
        uniforms(np.arange(6), np.zeros(6)),
        30,
        torch.device("cpu"),
    )
    tokens, logprobs = sample(logits, st)
    for row in (0, 2, 4):
        assert int(tokens[row]) == int(logits[row].argmax())
        assert float(logprobs[row]) == pytest.approx(
            float(torch.log_softmax(logits[row], -1).max()), abs=1e-6
        )
    all_greedy = SamplingTensors.build(
        [0.0] * 6,
        [-1] * 6,
        [1.0] * 6,
        [0.0] * 6,
        uniforms(np.arange(6), np.zeros(6)),
        30,
        torch.device("cpu"),
    )
    assert sample(logits, all_greedy)[0].tolist() == logits.argmax(-1).tolist()


def test_uniforms_depend_only_on_seed_and_position() -> None:
    a = uniforms([5, 6, 7], [0, 1, 2])
    b = uniforms([7, 5], [2, 0])
    assert a[2] == b[0] and a[0] == b[1]
    assert len(set(uniforms([1] * 100, np.arange(100)).tolist())) == 100
    u = uniforms(np.arange(100_000), np.zeros(100_000))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


def test_derived_seeds_are_splitmix64_of_the_parts() -> None:
    """`derive_seed` mixes in Python integers what `_splitmix64` mixes on uint64 arrays (seeds stay what they
    were when it used the arrays)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        parts = [int(x) for x in rng.integers(-(2**62), 2**62, size=int(rng.integers(1, 4)))]
        h = np.zeros(1, dtype=np.uint64)
        for part in parts:
            h = _splitmix64(h ^ np.uint64(part & 0xFFFFFFFFFFFFFFFF))
        assert derive_seed(*parts) == int(h[0] >> np.uint64(1))
    assert derive_seed(0) == 0xE220A8397B1DCDAF >> 1  # splitmix64 seeded with 0: its published first output


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # A tiny positive temperature overflows logits / T in float32: once a wrong token with a NaN logprob.
    with pytest.raises(ValueError, match="use 0 for greedy"):
        SamplingParams(temperature=1e-39)
    assert SamplingParams(temperature=1e-9).temperature == 1e-9  # near-greedy still samples
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(top_k=0).top_k == -1


def test_draws_follow_the_distribution_across_cdf_blocks() -> None:
    # A vocabulary of several 1024-token blocks: the two-level inverse CDF must weight blocks and tokens right.
    vocab, draws = 2500, 40_000
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(vocab, generator=gen) * 0.5
    heavy = torch.tensor([3, 700, 1023, 1024, 1500, 2047, 2048, 2499])
    logits[heavy] += torch.linspace(4.0, 6.0, len(heavy))
    tokens, _ = sample(logits.expand(draws, vocab), tensors(draws, vocab, 1.0, -1, 1.0, 0.0, seed0=5))
    probs = torch.softmax(logits.double(), -1)
    light = torch.ones(vocab, dtype=torch.bool)
    light[heavy] = False
    expected = torch.cat([probs[heavy], probs[light].sum()[None]]) * draws
    counts = torch.bincount(tokens, minlength=vocab).double()
    observed = torch.cat([counts[heavy], counts[light].sum()[None]])
    _, p_value = chisquare(observed.numpy(), (expected / expected.sum() * draws).numpy())
    assert p_value > 1e-4, (observed, expected)


@pytest.mark.parametrize("top_k", [-1, 3])
def test_a_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass(top_k: int) -> None:
    # u * total can round onto the total (forced here with u = 1): the draw must stop at the last token that
    # has any mass (here before whole 1024-token blocks of none), never run into the masked or filtered tail.
    vocab, rows = 2500, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2))
    logits[:, 1500:] = float("-inf")
    st = SamplingTensors.build(
        [1.0, 0.7, 1.3, 1.0],
        [top_k] * rows,
        [1.0] * rows,
        [0.0] * rows,
        np.ones(rows),
        vocab,
        torch.device("cpu"),
    )
    tokens, logprobs = sample(logits, st)
    # The draw runs in vocabulary order (filtered tokens weigh 0): the last token with mass is the highest id
    # the filter keeps.
    expected = 1499 if top_k < 0 else logits.argsort(dim=-1, descending=True)[:, :top_k].amax(dim=-1)
    assert (tokens == expected).all() and torch.isfinite(logprobs).all()


@pytest.mark.parametrize("top_k", [-1, 3])
def test_a_nan_row_gets_a_token_in_range_and_leaves_the_others_alone(top_k: int) -> None:
    # Deterministic mode pads a step with rows whose logits end up NaN; their tokens are dropped, but must
    # still index the vocabulary.
    vocab = 2500
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    logits[1] = float("nan")
    tokens, logprobs = sample(logits, tensors(3, vocab, 1.0, top_k, 1.0, 0.0))
    assert 0 <= int(tokens[1]) < vocab
    alone = [
        sample(logits[i : i + 1], tensors(3, vocab, 1.0, top_k, 1.0, 0.0).rows(slice(i, i + 1)))
        for i in (0, 2)
    ]
    assert tokens[[0, 2]].tolist() == [int(t) for t, _ in alone]
    assert logprobs[[0, 2]].tolist() == [float(lp) for _, lp in alone]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draw_from_block_masses_matches_the_full_weights(temperature: float) -> None:
    """The GPU engine's unfiltered draw (block totals, then one block's weights recomputed) picks the token
    the full float64 inverse CDF picks, with the same logprob; a vocabulary that is not a multiple of the
    block exercises the padding."""
    from miles.rollout.sampling.sampler import _sample_from_block_masses

    torch.manual_seed(0)
    rows, vocab = 64, 5000
    logits = torch.randn(rows, vocab) * 3
    params = SamplingTensors.build(
        [temperature] * rows,
        [0] * rows,
        [1.0] * rows,
        [0.0] * rows,
        uniforms(list(range(rows)), [3] * rows),
        vocab,
        torch.device("cpu"),
    )
    expected_tokens, expected_logprobs = sample(logits, params)
    tokens, logprobs = _sample_from_block_masses(logits, params.temperature, params.uniform)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_request_samples_alike_beside_requests_that_filter(deterministic: bool) -> None:
    """A request without top-k / top-p / min-p returns the same tokens and logprobs on its own and in steps
    where another request filters (the filtered path once drew every row of such a step over its sorted
    probabilities, so the same uniform number picked another token)."""
    from miles.rollout import Engine
    from miles.sample import Sample
    from tests.support.models import rollout_config, tiny_model

    model = tiny_model(False, seed=1)
    cfg = rollout_config(dict(kv_cache_bytes=8 * 1024 * 1024, deterministic=deterministic), {})
    plain = SamplingParams(temperature=0.9, max_new_tokens=10, seed=3, ignore_eos=True)
    alone = Engine(model, None, cfg).generate([Sample(prompt_ids=[5, 6, 7, 8])], plain)[0]
    for other in (plain.with_(top_k=5, seed=9), plain.with_(top_p=0.8, min_p=0.05, seed=9)):
        engine = Engine(model, None, cfg)
        rid = engine.add_request([5, 6, 7, 8], plain)
        engine.add_request([9, 10, 11], other)
        while engine.has_unfinished:
            engine.step()
        beside = engine.take_result(rid)
        assert beside.response_ids == alone.response_ids
        if deterministic:  # bit for bit (otherwise the batch's matmul shapes move the logits' last bits)
            assert beside.rollout_logprobs == alone.rollout_logprobs
        else:
            assert beside.rollout_logprobs == pytest.approx(alone.rollout_logprobs, abs=1e-5)
