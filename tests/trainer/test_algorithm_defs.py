"""The RL math against its published definitions, each reference written here from the definition in float64:
GRPO (verl's default: Bessel-corrected std, eps 1e-6), Dr. GRPO, RLOO, REINFORCE, PPO-clip with DAPO's
clip-higher, GSPO's sequence-level ratio, the three loss aggregations over unequal micro-batches, Schulman's
k1/k2/k3 in the direction KL(pi || pi_ref), TIS, entropy, DAPO's soft overlong punishment, and the edge cases
(groups of one, all-equal rewards, fully masked responses, non-finite rewards)."""

from __future__ import annotations

import copy
import math
import random
import statistics

import pytest
import torch

from miles.config import AlgorithmConfig, OptimConfig
from miles.sample import Sample
from miles.trainer.algorithms import compute_advantages, get_policy_loss
from miles.trainer.kl import kl_estimate
from miles.trainer.logprobs import chunked_logprobs
from miles.trainer.losses import LossNormalizer, PolicyLossInput
from miles.trainer.mismatch import tis_weights
from miles.trainer.overlong import overlong_penalty
from tests.support.trainer import make_trainer, random_samples, reference_logprobs, tiny_model


def scored(groups: list[list[float]]) -> list[Sample]:
    return [Sample(reward=r, group_id=g, index=i) for g, rs in enumerate(groups) for i, r in enumerate(rs)]


def random_groups(seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.choice([0.0, 0.3, 0.7, 1.0, -0.5]) for _ in range(rng.randint(2, 9))] for _ in range(12)]


# ---- advantages ----------------------------------------------------------------------------------------


def test_grpo_is_group_normalised_with_bessel_std_as_verl() -> None:
    groups = random_groups(0)
    samples = scored(groups)
    compute_advantages(samples, AlgorithmConfig(advantage="grpo", normalize_std=True))
    expected = []
    for rs in groups:
        mean = math.fsum(rs) / len(rs)
        std = statistics.stdev(rs)  # n - 1 in the denominator, as verl's torch.std
        expected += [0.0 if std == 0 else (r - mean) / (std + 1e-6) for r in rs]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_dr_grpo_never_divides_by_the_std(normalize_std: bool) -> None:
    groups = random_groups(1)
    samples = scored(groups)
    compute_advantages(samples, AlgorithmConfig(advantage="dr_grpo", normalize_std=normalize_std))
    expected = [r - math.fsum(rs) / len(rs) for rs in groups for r in rs]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)


def test_rloo_is_the_leave_one_out_baseline() -> None:
    groups = random_groups(2)
    samples = scored(groups)
    compute_advantages(samples, AlgorithmConfig(advantage="rloo"))
    expected = [
        r - math.fsum(rs[:i] + rs[i + 1 :]) / (len(rs) - 1) for rs in groups for i, r in enumerate(rs)
    ]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-12)


def test_reinforce_is_the_batch_mean_baseline() -> None:
    groups = random_groups(3)
    samples = scored(groups)
    compute_advantages(samples, AlgorithmConfig(advantage="reinforce"))
    flat = [r for rs in groups for r in rs]
    assert [s.advantage for s in samples] == pytest.approx([r - math.fsum(flat) / len(flat) for r in flat])


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_one_gets_zero_advantage(advantage: str) -> None:
    samples = scored([[0.9], [1.0, 0.0]])
    compute_advantages(samples, AlgorithmConfig(advantage=advantage))
    assert samples[0].advantage == 0.0


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce"])
def test_all_equal_rewards_give_exactly_zero_advantage(advantage: str) -> None:
    # 7 x 0.7 has a float mean of 0.7 + 1.1e-16, which, divided by a std of 1.2e-16 + 1e-6, used to leave an
    # advantage of -1.1e-10 on every sample: a same-signed push on a group the docs (and `adv/zero_std_frac`,
    # and DAPO's nonzero_std filter) treat as carrying no signal, which AdamW's first step scales up to
    # ~0.4 % of a full step.
    samples = scored([[0.7] * 7, [0.1] * 3]) if advantage != "reinforce" else scored([[0.7] * 7])
    metrics = compute_advantages(samples, AlgorithmConfig(advantage=advantage))
    assert [s.advantage for s in samples] == [0.0] * len(samples)
    assert not any(math.isnan(v) for v in metrics.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_are_an_error(bad: float) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(scored([[1.0, bad, 0.0]]), AlgorithmConfig())


# ---- policy losses ---------------------------------------------------------------------------------------


def loss_input(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    tis: torch.Tensor | None = None,
) -> PolicyLossInput:
    return PolicyLossInput(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=adv,
        loss_mask=mask,
        seq_index=seq_index,
        num_seqs=int(seq_index.max()) + 1,
        tis_weights=tis,
    )


@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_with_clip_higher_from_the_definition(clip_low: float, clip_high: float) -> None:
    g = torch.Generator().manual_seed(0)
    n = 400
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    tis = torch.rand(n, generator=g, dtype=torch.float64) * 2
    out = get_policy_loss("ppo_clip")(
        loss_input(logp, old, adv, torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.long), tis),
        AlgorithmConfig(clip_low=clip_low, clip_high=clip_high),
    )
    out.token_loss.sum().backward()
    for t in range(n):
        r, a, w = math.exp(logp[t].item() - old[t].item()), adv[t].item(), tis[t].item()
        clipped_r = min(max(r, 1 - clip_low), 1 + clip_high)
        objective = min(r * a, clipped_r * a)  # PPO-clip's pessimistic surrogate (Schulman et al. 2017)
        assert out.token_loss[t].item() == pytest.approx(-w * objective, abs=1e-12)
        # the gradient flows through r only where the unclipped term is the minimum
        unclipped_active = r * a < clipped_r * a or 1 - clip_low <= r <= 1 + clip_high
        expected_grad = -w * a * r if unclipped_active else 0.0
        assert logp.grad[t].item() == pytest.approx(expected_grad, abs=1e-12)
        assert out.token_metrics["train/clipfrac"][t].item() == float(clipped_r * a < r * a)
    frac = out.token_metrics["train/clipfrac"].mean().item()
    assert 0.05 < frac < 0.6  # both branches are exercised


def test_gspo_equals_the_sequence_level_objective_and_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 7, 1, 5, 4]
    seq_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    m = seq_index.numel()
    old = -torch.rand(m, generator=g, dtype=torch.float64) * 3
    logp0 = old + torch.randn(m, generator=g, dtype=torch.float64) * 0.02
    mask = (torch.rand(m, generator=g) > 0.25).double()
    mask[seq_index == 2] = 0.0  # a fully masked response: out of the objective
    adv_seq = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.8], dtype=torch.float64)
    cfg = AlgorithmConfig(clip_low=3e-4 * 20, clip_high=4e-4 * 20)

    logp = logp0.clone().requires_grad_(True)
    out = get_policy_loss("gspo")(loss_input(logp, old, adv_seq[seq_index], mask, seq_index), cfg)
    normalizer = LossNormalizer.from_masks("seq_mean_token_mean", [mask[seq_index == i] for i in range(5)])
    loss = (out.token_loss * normalizer.token_weights(mask, seq_index, 5)).sum()
    loss.backward()

    # GSPO (Zheng et al. 2025): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), J = mean_i min(s_i A_i, clip(s_i) A_i)
    ref_logp = logp0.clone().requires_grad_(True)
    terms = []
    for i in range(5):
        sel = (seq_index == i) & (mask > 0)
        if not sel.any():
            continue
        s = torch.exp((ref_logp[sel] - old[sel]).sum() / sel.sum())
        terms.append(torch.minimum(s * adv_seq[i], s.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv_seq[i]))
    reference = -torch.stack(terms).mean()
    reference.backward()
    # the aggregation weights are float32 (the trainer's loss is), hence 1e-6 rather than 1e-12
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(logp.grad, ref_logp.grad, atol=1e-9, rtol=1e-6)
    assert out.token_metrics["train/clipfrac"].max().item() == 1.0  # the check covers a clipped sequence


# ---- aggregation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_over_unequal_micro_batches_is_the_whole_batch_s(mode: str) -> None:
    g = torch.Generator().manual_seed(2)
    lengths = [1, 2, 30, 4, 9, 3]
    values = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.3).double() for n in lengths]
    masks[1] = torch.zeros(2, dtype=torch.float64)  # fully masked: not a sequence of S
    masks[0] = torch.ones(1, dtype=torch.float64)
    live = [i for i, mk in enumerate(masks) if mk.sum() > 0]
    if mode == "token_mean":
        expected = sum((v * mk).sum() for v, mk in zip(values, masks)) / sum(mk.sum() for mk in masks)
    elif mode == "seq_mean_token_mean":
        expected = sum((values[i] * masks[i]).sum() / masks[i].sum() for i in live) / len(live)
    else:
        expected = sum((values[i] * masks[i]).sum() for i in live) / len(live)
    normalizer = LossNormalizer.from_masks(mode, masks)
    total = 0.0
    micro_batch_means = []
    for ids in ([0, 1], [2], [3, 4, 5]):  # 1, 30 and 14 tokens
        v = torch.cat([values[i] for i in ids])
        mk = torch.cat([masks[i] for i in ids])
        seq = torch.cat([torch.full((lengths[i],), j) for j, i in enumerate(ids)])
        total += (v * normalizer.token_weights(mk, seq, len(ids))).sum().item()
        micro_batch_means.append(((v * mk).sum() / mk.sum().clamp(min=1)).item())
    assert total == pytest.approx(expected.item(), rel=1e-6)  # float32 weights
    if mode == "token_mean":  # the classic bug, averaging micro-batch means, gives another number here
        assert abs(sum(micro_batch_means) / 3 - expected.item()) > 1e-3


# ---- KL, TIS, entropy, overlong --------------------------------------------------------------------------


def test_kl_estimators_are_schulman_s_in_the_direction_policy_to_reference() -> None:
    policy = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    reference = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    exact = math.fsum(p * math.log(p / q) for p, q in zip(policy.tolist(), reference.tolist()))
    for x in range(4):  # per token: r = pi_ref / pi of a token x ~ pi
        r = reference[x].item() / policy[x].item()
        k = {
            e: kl_estimate(policy.log()[x : x + 1], reference.log()[x : x + 1], e).item()
            for e in ("k1", "k2", "k3")
        }
        assert k["k1"] == pytest.approx(-math.log(r), abs=1e-12)
        assert k["k2"] == pytest.approx(0.5 * math.log(r) ** 2, abs=1e-12)
        assert k["k3"] == pytest.approx((r - 1) - math.log(r), abs=1e-12)
    for e in ("k1", "k3"):  # unbiased for KL(pi || pi_ref) under pi, not for KL(pi_ref || pi)
        assert (policy * kl_estimate(policy.log(), reference.log(), e)).sum().item() == pytest.approx(exact)


def test_train_kl_is_the_token_mean_k3_of_policy_against_reference() -> None:
    samples = random_samples(5, seed=4)
    for s in samples:
        s.advantage = 0.0
    samples[1].loss_mask = [0] * len(samples[1].response_ids)
    policy, ref = tiny_model(0), tiny_model(1)
    metrics = make_trainer(
        policy, ref, AlgorithmConfig(tis=False, kl_coef=0.1, kl_estimator="k3"), lr=0.0
    ).train_step(samples)
    values = []
    with torch.no_grad():
        for s in samples:
            lp, rl = reference_logprobs(policy, s)[0].double(), reference_logprobs(ref, s)[0].double()
            mask = s.loss_mask or [1] * len(s.response_ids)
            values += [math.exp(b - a) - 1 - (b - a) for a, b, k in zip(lp.tolist(), rl.tolist(), mask) if k]
    assert metrics["train/kl"] == pytest.approx(math.fsum(values) / len(values), rel=1e-4)


def test_train_kl_is_logged_as_zero_when_kl_coef_is_zero() -> None:
    # The docs: "With kl_coef=0, train/kl is logged as 0"; a trainer given a reference model it does not use
    # (kl_coef=0) logged no train/kl at all.
    samples = random_samples(4, seed=5)
    for s in samples:
        s.advantage = 1.0
    metrics = make_trainer(tiny_model(0), tiny_model(1), AlgorithmConfig(tis=False, kl_coef=0.0)).train_step(
        samples
    )
    assert metrics["train/kl"] == 0.0


def test_tis_weight_is_min_of_old_over_rollout_and_cap() -> None:
    # w = min(pi_old / pi_rollout, C) (Yao et al.); its detachment is checked end to end below, where the
    # definition's weights are constants and the gradients agree
    old = [torch.tensor([-1.0, -0.2, -3.0])]
    rollout = [torch.tensor([-1.5, -2.0, -2.5])]
    weights, metrics = tis_weights(old, rollout, [torch.tensor([1.0, 1.0, 0.0])], cap=2.0)
    expected = [min(math.exp(o - r), 2.0) for o, r in zip([-1.0, -0.2, -3.0], [-1.5, -2.0, -2.5])]
    assert weights[0].tolist() == pytest.approx(expected)
    assert metrics["mismatch/tis_clipfrac"] == pytest.approx(0.5)  # of the two loss tokens, e^1.8 > 2


def test_entropy_and_logprobs_from_the_definition() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(13, 6, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 13, (9,), generator=g)
    temperature = 0.7
    logprobs, entropy = chunked_logprobs(
        hidden, weight, targets, temperature, with_entropy=True, rows_per_chunk=4
    )
    for row in range(9):
        z = [(hidden[row] @ weight[v]).item() / temperature for v in range(13)]
        top = max(z)
        log_norm = top + math.log(math.fsum(math.exp(x - top) for x in z))
        p = [math.exp(x - log_norm) for x in z]
        assert logprobs[row].item() == pytest.approx(z[targets[row]] - log_norm, abs=1e-5)
        assert entropy[row].item() == pytest.approx(-math.fsum(q * math.log(q) for q in p), abs=1e-5)


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_penalty_is_dapo_s_soft_punishment(penalty: float) -> None:
    max_length, buffer = 20, 5
    for length in range(0, 26):
        # DAPO eq. 13: 0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the buffer; -1 past
        if length <= max_length - buffer:
            expected = 0.0
        elif length <= max_length:
            expected = ((max_length - buffer) - length) / buffer
        else:
            expected = -1.0
        assert overlong_penalty(length, max_length, buffer, penalty) == pytest.approx(penalty * expected)


# ---- the trainer end to end ------------------------------------------------------------------------------


def definition_loss(
    model: torch.nn.Module,
    base: torch.nn.Module,
    ref: torch.nn.Module,
    samples: list[Sample],
    algo: AlgorithmConfig,
) -> torch.Tensor:
    """The whole optimizer batch's loss in float64 from the definitions: old = the weights before the update,
    TIS against the rollout logprobs, k3 to the reference, entropy bonus, one of the three aggregations."""
    per_seq, counts = [], []
    for s in samples:
        logp, entropy = (x.double() for x in reference_logprobs(model, s))
        with torch.no_grad():
            old = reference_logprobs(base, s)[0].double()
            ref_logp = reference_logprobs(ref, s)[0].double()
        mask = torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.float64)
        if algo.policy_loss == "gspo":  # one ratio per sequence; the clip acts on it
            seq = torch.exp(((logp - old) * mask).sum() / mask.sum().clamp(min=1))
            ratio = seq.detach() * torch.exp(logp - logp.detach())
        else:
            ratio = torch.exp(logp - old)
        a = s.advantage
        loss = -torch.minimum(ratio * a, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * a)
        loss = loss * torch.exp(old - torch.tensor(s.rollout_logprobs, dtype=torch.float64)).clamp(
            max=algo.tis_cap
        )
        log_r = ref_logp - logp
        loss = loss + algo.kl_coef * (torch.exp(log_r) - 1 - log_r) - algo.entropy_coef * entropy
        per_seq.append((loss * mask).sum())
        counts.append(mask.sum())
    live = [i for i, c in enumerate(counts) if c > 0]
    if algo.loss_agg == "token_mean":
        return sum(per_seq) / sum(counts)
    if algo.loss_agg == "seq_mean_token_mean":
        return sum(per_seq[i] / counts[i] for i in live) / len(live)
    return sum(per_seq[i] for i in live) / len(live)


@pytest.mark.parametrize(
    ("policy_loss", "loss_agg"),
    [("ppo_clip", "token_mean"), ("ppo_clip", "seq_mean_token_sum"), ("gspo", "seq_mean_token_mean")],
)
def test_off_policy_epochs_with_tis_kl_and_entropy_match_the_definition(
    policy_loss: str, loss_agg: str
) -> None:
    """Two epochs (the second off-policy, with clipped ratios), micro-batches of unequal token counts, partial and
    fully masked responses: each optimizer step's gradient is the definition's."""
    samples = random_samples(6, seed=1)
    base, ref = tiny_model(0), tiny_model(1)
    for i, s in enumerate(samples):
        s.advantage = [0.5, -1.0, 1.5, -0.25, 1.0, -2.0][i]
        exact = reference_logprobs(base, s)[0].detach()
        s.rollout_logprobs = (exact - [0.3, -0.9, 0.1, 1.2, 0.0, -0.2][i]).tolist()
    samples[2].loss_mask = [1] + [0] * (len(samples[2].response_ids) - 1)
    samples[4].loss_mask = [0] * len(samples[4].response_ids)
    algo = AlgorithmConfig(
        policy_loss=policy_loss,
        loss_agg=loss_agg,
        tis=True,
        tis_cap=2.0,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.02,
        clip_low=0.02,
        clip_high=0.03,
    )
    model = copy.deepcopy(base)
    trainer = make_trainer(
        model,
        ref,
        algo,
        lr=0.05,
        micro_batch_tokens=12,
        global_batch_size=64,
        epochs_per_rollout=2,
        optim=OptimConfig(grad_clip=0.0),
    )
    kept: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    step = trainer.optimizer.step

    def step_and_keep(*args, **kwargs):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        tensors = [t for group in trainer.optimizer.param_groups for t in group["params"]]
        kept.append((weights, {trainer._names[id(t)]: t.grad.clone() for t in tensors if t.grad is not None}))
        return step(*args, **kwargs)

    trainer.optimizer.step = step_and_keep
    metrics = trainer.train_step(samples)
    assert len(kept) == 2 and metrics["train/clipfrac"] > 0  # the second epoch clips
    for weights, grads in kept:
        at_step = copy.deepcopy(base)
        at_step.load_state_dict(weights)
        definition_loss(at_step, base, ref, samples, algo).backward()
        for name, param in at_step.named_parameters():
            torch.testing.assert_close(grads[name].double(), param.grad.double(), atol=2e-5, rtol=0)


def test_fully_masked_batch_skips_the_step_without_nan() -> None:
    samples = random_samples(4, seed=6)
    base = tiny_model(0)
    for s in samples:
        s.advantage = 1.0
        s.loss_mask = [0] * len(s.response_ids)
        s.rollout_logprobs = (reference_logprobs(base, s)[0].detach() - 0.3).tolist()
    for policy_loss, loss_agg in (("ppo_clip", "token_mean"), ("gspo", "seq_mean_token_mean")):
        model = copy.deepcopy(base)
        algo = AlgorithmConfig(policy_loss=policy_loss, loss_agg=loss_agg, entropy_coef=0.01)
        metrics = make_trainer(model, None, algo, lr=0.1).train_step(samples)
        assert metrics["train/skipped_steps"] == 1.0
        assert all(math.isfinite(v) for v in metrics.values())
        assert all(torch.equal(a, b) for a, b in zip(base.parameters(), model.parameters()))
