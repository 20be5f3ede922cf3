"""Algorithm math (advantages, PPO/GSPO/SFT losses, aggregation, KL estimators, TIS) against hand computation."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from miles.config import AlgorithmConfig
from miles.sample import Sample
from miles.trainer.algorithms import compute_advantages, get_advantage, get_policy_loss, register_advantage
from miles.trainer.kl import kl_estimate
from miles.trainer.losses import LossNormalizer, PolicyLossInput
from miles.trainer.mismatch import mismatch_metrics, tis_weights


def scored(rewards_by_group: list[list[float]]) -> list[Sample]:
    return [
        Sample(reward=r, group_id=g, index=i)
        for g, rewards in enumerate(rewards_by_group)
        for i, r in enumerate(rewards)
    ]


def test_grpo_advantages_hand_computed() -> None:
    samples = scored([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.2, 0.8]])
    metrics = compute_advantages(samples, AlgorithmConfig(advantage="grpo", normalize_std=True))
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: mean 0.5, std sqrt(2 * 0.09 / 1) = 0.3*sqrt(2)
    a0 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    a2 = 0.3 / (0.3 * math.sqrt(2) + 1e-6)
    expected = [a0, -a0, -a0, a0, 0.0, 0.0, 0.0, -a2, a2]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)
    assert metrics["adv/zero_std_frac"] == pytest.approx(1 / 3)
    assert metrics["adv/num_groups"] == 3
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["adv/max"] == pytest.approx(a0)


def test_dr_grpo_rloo_reinforce_hand_computed() -> None:
    samples = scored([[1.0, 0.0, 0.0, 1.0], [3.0]])
    compute_advantages(samples, AlgorithmConfig(advantage="grpo", normalize_std=False))
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])
    compute_advantages(samples, AlgorithmConfig(advantage="dr_grpo", normalize_std=True))
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])
    compute_advantages(samples, AlgorithmConfig(advantage="rloo"))
    assert [s.advantage for s in samples] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])
    compute_advantages(samples, AlgorithmConfig(advantage="reinforce"))  # batch mean 1.0
    assert [s.advantage for s in samples] == pytest.approx([0.0, -1.0, -1.0, 0.0, 2.0])


def test_nan_reward_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="non-finite rewards"):
        compute_advantages(scored([[1.0, float("nan")]]), AlgorithmConfig())


def test_registry_names_and_dotted_paths(tmp_path, monkeypatch) -> None:
    @register_advantage("test_constant_seven")
    def constant(samples, cfg):
        return [7.0] * len(samples)

    samples = scored([[0.0, 1.0]])
    compute_advantages(samples, AlgorithmConfig(advantage="test_constant_seven"))
    assert [s.advantage for s in samples] == [7.0, 7.0]

    (tmp_path / "my_algo_plugin.py").write_text(
        textwrap.dedent("""
        def doubled_reward(samples, cfg):
            return [2 * s.reward for s in samples]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    compute_advantages(samples, AlgorithmConfig(advantage="my_algo_plugin:doubled_reward"))
    assert [s.advantage for s in samples] == [0.0, 2.0]
    sys.modules.pop("my_algo_plugin", None)

    with pytest.raises(KeyError, match="registered: .*grpo"):
        get_advantage("no_such_estimator")
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("no_such_loss")
    register_advantage("test_wrong_length")(lambda samples, cfg: [0.0])
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        compute_advantages(samples, AlgorithmConfig(advantage="test_wrong_length"))


def loss_input(logprobs, old, adv, mask=None, seq_index=None, tis=None) -> PolicyLossInput:
    logprobs = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    n = logprobs.numel()
    return PolicyLossInput(
        logprobs=logprobs,
        old_logprobs=torch.tensor(old, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask if mask is not None else [1.0] * n, dtype=torch.float64),
        seq_index=torch.tensor(seq_index if seq_index is not None else [0] * n),
        num_seqs=1 + max(seq_index or [0]),
        tis_weights=None if tis is None else torch.tensor(tis, dtype=torch.float64),
    )


def test_ppo_clip_values_gradient_and_clipfrac() -> None:
    ratios = [1.5, 0.5, 1.1, 0.7]
    batch = loss_input([math.log(r) for r in ratios], [0.0] * 4, [1.0, 1.0, -1.0, -1.0])
    out = get_policy_loss("ppo_clip")(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.2))
    # max(-A r, -A clip(r, 0.8, 1.2)) per token
    assert out.token_loss.tolist() == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert out.token_metrics["train/clipfrac"].tolist() == [1.0, 0.0, 0.0, 1.0]
    out.token_loss.sum().backward()
    # d/dlogp (-A r) = -A r where the unclipped branch is active; 0 where the clip is active
    assert batch.logprobs.grad.tolist() == pytest.approx([0.0, -0.5, 1.1, 0.0])


def test_clip_higher_is_asymmetric() -> None:
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    ratios = [1.25, 1.35, 0.75, 0.85]
    batch = loss_input([math.log(r) for r in ratios], [0.0] * 4, [1.0, 1.0, -1.0, -1.0])
    out = get_policy_loss("ppo_clip")(batch, cfg)
    # positive advantage clips only above 1.28; negative advantage clips below 0.8
    assert out.token_loss.tolist() == pytest.approx([-1.25, -1.28, 0.8, 0.85])
    assert out.token_metrics["train/clipfrac"].tolist() == [0.0, 1.0, 1.0, 0.0]
    symmetric = get_policy_loss("ppo_clip")(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.2))
    assert symmetric.token_loss[0].item() == pytest.approx(-1.2)


def test_tis_weights_multiply_the_policy_loss() -> None:
    batch = loss_input([0.0, 0.0], [0.0, 0.0], [1.0, -2.0], tis=[0.5, 2.0])
    out = get_policy_loss("ppo_clip")(batch, AlgorithmConfig())
    assert out.token_loss.tolist() == pytest.approx([-0.5, 4.0])


def test_tis_weight_cap_and_clipfrac() -> None:
    old = [torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-2.0])]
    rollout = [torch.tensor([-1.0, -2.0, -0.5]), None]
    masks = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0])]
    weights, metrics = tis_weights(old, rollout, masks, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, math.exp(-0.5)])
    assert weights[1].tolist() == [1.0]  # no rollout logprobs: weight 1
    assert metrics["mismatch/tis_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["mismatch/tis_weight_mean"] == pytest.approx((1.0 + 2.0 + math.exp(-0.5)) / 3)


def test_mismatch_metrics_hand_computed() -> None:
    old = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -0.5])]
    rollout = [torch.tensor([-1.1, -1.7, -9.0]), torch.tensor([-0.5, -0.5])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]  # the masked token's 6.0 gap is ignored
    metrics = mismatch_metrics(old, rollout, masks)
    deltas = [0.1, -0.3, 0.0, 0.0]  # trainer - rollout over loss tokens
    assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.1, abs=1e-6)
    assert metrics["mismatch/logprob_abs_diff_max"] == pytest.approx(0.3, abs=1e-6)
    expected_kl = sum(math.exp(d) - 1 - d for d in deltas) / 4
    assert metrics["mismatch/kl"] == pytest.approx(expected_kl, rel=1e-5)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7 / 3),
        ("seq_mean_token_mean", (1.5 + 4.0) / 2),
        ("seq_mean_token_sum", (3.0 + 4.0) / 2),
    ],
)
def test_loss_aggregation_modes(mode: str, expected: float) -> None:
    # seq 0: losses [1, 2, 3] with mask [1, 1, 0]; seq 1: loss [4]; seq 2 fully masked (excluded from S)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    seq_index = torch.tensor([0, 0, 0, 1, 2])
    normalizer = LossNormalizer.from_masks(mode, [mask[:3], mask[3:4], mask[4:]])
    assert (normalizer.num_tokens, normalizer.num_seqs) == (3, 2)
    whole = (values * normalizer.token_weights(mask, seq_index, 3)).sum()
    assert whole.item() == pytest.approx(expected)
    # the same batch split into two micro-batches sums to the same value
    part_a = (values[:3] * normalizer.token_weights(mask[:3], seq_index[:3], 1)).sum()
    part_b = (values[3:] * normalizer.token_weights(mask[3:], seq_index[3:] - 1, 2)).sum()
    assert (part_a + part_b).item() == pytest.approx(expected)


def test_normalizer_counts_match_per_mask_sums() -> None:
    # One sync for the batch: the counts equal the per-mask definition, empty and all-zero masks included.
    g = torch.Generator().manual_seed(0)
    masks = [(torch.rand(int(n), generator=g) < 0.6).float() for n in torch.randint(0, 9, (40,), generator=g)]
    masks += [torch.zeros(0), torch.zeros(3)]
    sums = [int(m.sum().item()) for m in masks]
    normalizer = LossNormalizer.from_masks("token_mean", masks)
    assert (normalizer.num_tokens, normalizer.num_seqs) == (sum(sums), sum(1 for s in sums if s > 0))
    empty = LossNormalizer.from_masks("token_mean", [])
    assert (empty.num_tokens, empty.num_seqs) == (0, 0)


def test_unknown_aggregation_is_rejected() -> None:
    with pytest.raises(ValueError, match="token_mean"):
        LossNormalizer("mean", 1, 1)


def test_kl_estimators_hand_values() -> None:
    logp, logq = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # log q - log p
    assert kl_estimate(logp, logq, "k1").item() == pytest.approx(-log_r)
    assert kl_estimate(logp, logq, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_estimate(logp, logq, "k3").item() == pytest.approx(0.5 - 1 - log_r)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, logq, "k4")


def test_k1_and_k3_are_unbiased_for_the_exact_kl() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    exact = (p * (p / q).log()).sum().item()
    for estimator in ("k1", "k3"):
        expectation = (p * kl_estimate(p.log(), q.log(), estimator)).sum().item()
        assert expectation == pytest.approx(exact, rel=1e-12)
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()


def test_gspo_uses_the_length_normalised_sequence_ratio() -> None:
    # seq 0 log-ratios [0.1, 0.3] -> s = exp(0.2); seq 1 log-ratio [0.5] -> s = exp(0.5), clipped at 1.28 (A > 0)
    batch = loss_input([0.1, 0.3, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], seq_index=[0, 0, 1])
    out = get_policy_loss("gspo")(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    s0 = math.exp(0.2)
    assert out.token_loss.tolist() == pytest.approx([-s0, -s0, -1.28])
    assert out.token_metrics["train/clipfrac"].tolist() == [0.0, 0.0, 1.0]
    out.token_loss.sum().backward()
    # gradient of sg[s] * pi_t / sg[pi_t] w.r.t. log pi_t is s (times -A)
    assert batch.logprobs.grad.tolist() == pytest.approx([-s0, -s0, 0.0])


def test_sft_loss_is_the_negative_logprob() -> None:
    batch = loss_input([-0.5, -2.0], [0.0, 0.0], [9.0, 9.0])
    out = get_policy_loss("sft")(batch, AlgorithmConfig())
    assert out.token_loss.tolist() == pytest.approx([0.5, 2.0])
