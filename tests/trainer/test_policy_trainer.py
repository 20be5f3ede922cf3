"""PolicyTrainer on a tiny Qwen3-MoE: packed logprobs vs a plain forward, gradient accumulation vs a
hand-written big-batch loss, learning direction, SFT, LR schedule, optimizer state, routing replay."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.models import CausalLM, RoutingTrace, VarlenAttention
from miles.sample import Sample
from miles.trainer.kl import kl_estimate
from miles.trainer.logprobs import packed_logprobs
from miles.trainer.optim import lr_multiplier
from miles.trainer.packing import fed_length, pack
from tests.support.trainer import (
    VOCAB,
    keep_gradients,
    make_trainer,
    random_samples,
    reference_logprobs,
    tiny_model,
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_equal_unpacked_full_forward(temperature: float) -> None:
    model = tiny_model()
    samples = random_samples(7) + [Sample(prompt_ids=list(range(20)), response_ids=list(range(5, 12)))]
    batches = pack(samples, list(range(len(samples))), 16, torch.device("cpu"))
    assert len(batches) < len(samples)  # several sequences share a micro-batch
    assert any(b.num_tokens > 16 for b in batches)  # the over-long sample went alone
    with torch.no_grad():
        for batch in batches:
            out = packed_logprobs(model, batch, temperature, with_entropy=True)
            for i, lp, ent in zip(
                batch.sample_ids, batch.per_sample(out.logprobs), batch.per_sample(out.entropy)
            ):
                ref_lp, ref_ent = reference_logprobs(model, samples[i], temperature)
                torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
                torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
        trainer = make_trainer(model, micro_batch_tokens=16, temperature=temperature)
        for sample, lp in zip(samples, trainer.logprobs(samples)):
            torch.testing.assert_close(
                lp, reference_logprobs(model, sample, temperature)[0], atol=1e-5, rtol=0
            )


def hand_written_loss(model, ref, samples, mode, kl_coef, entropy_coef) -> torch.Tensor:
    """The big-batch GRPO/PPO loss (first epoch: ratio = 1 with gradient) written directly from the formulas."""
    per_seq, counts = [], []
    for s in samples:
        lp, entropy = reference_logprobs(model, s)
        ratio = torch.exp(lp - lp.detach())
        token_loss = -s.advantage * ratio
        if kl_coef:
            with torch.no_grad():
                ref_lp, _ = reference_logprobs(ref, s)
            token_loss = token_loss + kl_coef * kl_estimate(lp, ref_lp, "k3")
        token_loss = token_loss - entropy_coef * entropy
        mask = torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.float32)
        per_seq.append((token_loss * mask).sum())
        counts.append(mask.sum())
    total_tokens = sum(counts)
    live = [i for i, c in enumerate(counts) if c > 0]
    if mode == "token_mean":
        return sum(per_seq) / total_tokens
    if mode == "seq_mean_token_mean":
        return sum(per_seq[i] / counts[i] for i in live) / len(live)
    return sum(per_seq[i] for i in live) / len(live)


@pytest.mark.parametrize(
    ("mode", "kl_coef", "entropy_coef"),
    [("token_mean", 0.0, 0.0), ("seq_mean_token_mean", 0.0, 0.05), ("seq_mean_token_sum", 0.3, 0.0)],
)
def test_accumulated_gradients_equal_one_big_batch(mode: str, kl_coef: float, entropy_coef: float) -> None:
    samples = random_samples(6, seed=1)
    for i, s in enumerate(samples):
        s.advantage = [0.5, -1.0, 1.5, -0.25, 1.0, -2.0][i]
    samples[2].loss_mask = [1] + [0] * (len(samples[2].response_ids) - 1)
    algorithm = AlgorithmConfig(
        tis=False, loss_agg=mode, kl_coef=kl_coef, kl_estimator="k3", entropy_coef=entropy_coef
    )
    base, ref = tiny_model(0), tiny_model(1)
    grads = {}
    for budget in (12, 10_000):  # many micro-batches vs one
        model = copy.deepcopy(base)
        trainer = make_trainer(
            model,
            ref if kl_coef else None,
            algorithm,
            lr=0.0,
            micro_batch_tokens=budget,
            global_batch_size=64,
        )
        kept = keep_gradients(trainer)
        metrics = trainer.train_step(samples)
        grads[budget] = kept[0]
        assert all(p.grad is None for p in model.parameters())  # freed after the update
    reference = copy.deepcopy(base)
    loss = hand_written_loss(reference, ref, samples, mode, kl_coef, entropy_coef)
    loss.backward()
    assert metrics["train/loss"] == pytest.approx(loss.item(), abs=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[12][name], grads[10_000][name], atol=1e-5, rtol=0)
        torch.testing.assert_close(grads[12][name], param.grad, atol=1e-5, rtol=0)
    assert max(g.abs().max().item() for g in grads[12].values()) > 1e-3  # the check is not vacuous


def test_train_step_moves_logprobs_in_the_advantage_direction() -> None:
    model = tiny_model(0, std=0.05)
    samples = random_samples(4, seed=2)
    for s, adv in zip(samples, [1.0, 1.0, -1.0, -1.0]):
        s.advantage = adv
    trainer = make_trainer(model, lr=1e-2, global_batch_size=4, micro_batch_tokens=12)
    before = [lp.sum().item() for lp in trainer.logprobs(samples)]
    for _ in range(3):
        metrics = trainer.train_step(samples)
    after = [lp.sum().item() for lp in trainer.logprobs(samples)]
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.1
    assert after[2] < before[2] - 0.1 and after[3] < before[3] - 0.1
    for name in (
        "train/loss",
        "train/pg_loss",
        "train/kl",
        "train/entropy",
        "train/clipfrac",
        "train/grad_norm",
        "train/lr",
        "train/tokens",
    ):
        assert math.isfinite(metrics[name]), name
    assert metrics["train/tokens"] == sum(fed_length(s) for s in samples)
    assert 0 < metrics["train/entropy"] <= math.log(VOCAB) + 1e-5


def test_ppo_epochs_and_minibatches_clip_off_policy_ratios() -> None:
    samples = random_samples(8, seed=3)
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    trainer = make_trainer(
        tiny_model(0),
        lr=5e-2,
        global_batch_size=2,
        epochs_per_rollout=2,
        algorithm=AlgorithmConfig(tis=False, clip_low=0.01, clip_high=0.01),
    )
    metrics = trainer.train_step(samples)
    assert metrics["train/optimizer_steps"] == 8  # 4 minibatches x 2 epochs
    assert metrics["train/clipfrac"] > 0  # later minibatches are off-policy by several large steps
    assert trainer.total_optimizer_steps == TrainerConfig().max_steps * 4 * 2


def test_a_resized_schedule_ends_at_the_run_s_last_step() -> None:
    """A resumed run whose batch size changed: the schedule is the steps already taken plus the calls left
    times the steps a call now takes, so the LR reaches its end at the run's last step."""
    samples = random_samples(8, seed=3)
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    first = make_trainer(tiny_model(0), lr=1e-2, max_steps=4, global_batch_size=4)
    for _ in range(2):
        first.train_step(samples)  # 2 optimizer steps a call
    assert first.total_optimizer_steps == 8 and first.optimizer_steps_done == 4
    resumed = make_trainer(copy.deepcopy(first.model), lr=1e-2, max_steps=4, global_batch_size=2)
    resumed.load_state_dict(first.state_dict())
    resumed.resize_schedule(2)
    resumed.train_step(samples)  # 4 optimizer steps a call now
    assert resumed.total_optimizer_steps == 4 + 2 * 4
    resumed.train_step(samples)
    assert resumed.optimizer_steps_done == resumed.total_optimizer_steps == 12


def test_sft_step_reduces_nll() -> None:
    model = tiny_model(0, std=0.05)
    samples = random_samples(6, seed=4)
    trainer = make_trainer(
        model, lr=1e-2, micro_batch_tokens=10, algorithm=AlgorithmConfig(policy_loss="sft")
    )
    first = trainer.sft_step(samples)
    expected_nll = (
        -torch.cat([reference_logprobs(tiny_model(0, std=0.05), s)[0] for s in samples]).mean().item()
    )
    assert first["train/nll"] == pytest.approx(expected_nll, abs=1e-5)
    for _ in range(4):
        last = trainer.sft_step(samples)
    final_nll = -torch.cat(trainer.logprobs(samples, temperature=1.0)).mean().item()
    assert last["train/nll"] < first["train/nll"] - 0.2
    assert final_nll < last["train/nll"]


def test_lr_schedule_values() -> None:
    cosine = OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(s, cosine, total_steps=10) for s in range(12)]
    decay = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(8)]
    assert values == pytest.approx([0.5, 1.0, *decay, 0.1, 0.1])
    constant = OptimConfig(warmup_steps=3, schedule="constant")
    assert [lr_multiplier(s, constant, None) for s in range(5)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    )
    with pytest.raises(ValueError, match="constant, cosine"):
        lr_multiplier(0, OptimConfig(schedule="linear"), 10)

    trainer = make_trainer(
        tiny_model(),
        lr=0.1,
        optim=OptimConfig(warmup_steps=1, schedule="cosine", min_lr_ratio=0.0),
        algorithm=AlgorithmConfig(policy_loss="sft"),
    )
    trainer.set_total_optimizer_steps(3)
    lrs = [trainer.sft_step(random_samples(2))["train/lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.1, 0.1, 0.0])


def test_optimizer_state_round_trips_through_safetensors(tmp_path) -> None:
    samples = random_samples(4, seed=5)
    cfg = dict(
        lr=1e-2,
        optim=OptimConfig(warmup_steps=0, schedule="cosine", weight_decay=0.1),
        algorithm=AlgorithmConfig(policy_loss="sft"),
    )
    model_a = tiny_model()
    trainer_a = make_trainer(model_a, **copy.deepcopy(cfg))
    trainer_a.set_total_optimizer_steps(5)
    trainer_a.sft_step(samples)
    state = trainer_a.state_dict()
    save_file(state["tensors"], tmp_path / "optimizer.safetensors")
    (tmp_path / "optimizer.json").write_text(json.dumps(state["meta"]))

    model_b = copy.deepcopy(model_a)
    trainer_b = make_trainer(model_b, **copy.deepcopy(cfg))
    trainer_b.load_state_dict(
        {
            "tensors": load_file(tmp_path / "optimizer.safetensors"),
            "meta": json.loads((tmp_path / "optimizer.json").read_text()),
        }
    )
    metrics_a, metrics_b = trainer_a.sft_step(samples), trainer_b.sft_step(samples)
    assert metrics_a["train/lr"] == metrics_b["train/lr"] < 1e-2
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name

    # a checkpoint from a GPU run (fused AdamW) resumes here with this machine's implementation
    gpu_meta = copy.deepcopy(state["meta"])
    for group in gpu_meta["param_groups"]:
        group["hyper"].update(fused=True, foreach=None)
    trainer_c = make_trainer(copy.deepcopy(model_a), **copy.deepcopy(cfg))
    trainer_c.load_state_dict({"tensors": state["tensors"], "meta": gpu_meta})
    assert [g["fused"] for g in trainer_c.optimizer.param_groups] == [None] * len(gpu_meta["param_groups"])

    other = tiny_model()
    other.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="does not match"):
        make_trainer(other, **copy.deepcopy(cfg)).load_state_dict(state)


def test_resume_takes_optimizer_hyperparameters_from_the_current_config() -> None:
    """The checkpoint gives AdamW's moments; weight_decay, betas and eps changed for the resume apply."""
    samples = random_samples(4, seed=5)
    sft = AlgorithmConfig(policy_loss="sft")
    old = OptimConfig(grad_clip=0.0, weight_decay=0.0, betas=[0.9, 0.999], eps=1e-8)
    trainer_a = make_trainer(tiny_model(), algorithm=sft, lr=1e-2, optim=old)
    trainer_a.sft_step(samples)
    state = trainer_a.state_dict()

    new = OptimConfig(grad_clip=0.0, weight_decay=0.1, betas=[0.5, 0.9], eps=1e-3)
    trainer_b = make_trainer(copy.deepcopy(trainer_a.model), algorithm=sft, lr=1e-2, optim=new)
    trainer_b.load_state_dict(state)
    hyper = [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in trainer_b.optimizer.param_groups]
    assert hyper == [(0.1, (0.5, 0.9), 1e-3), (0.0, (0.5, 0.9), 1e-3)]  # norms and biases: no decay
    # ...while the per-parameter state is the checkpoint's
    for group in trainer_b.optimizer.param_groups:
        for param in group["params"]:
            name = trainer_b._names[id(param)]
            saved = state["tensors"][f"optimizer.{name}.exp_avg"]
            assert torch.equal(trainer_b.optimizer.state[param]["exp_avg"], saved), name
    assert trainer_b.optimizer_steps_done == 1


def forced_routing(model: CausalLM, sample: Sample) -> tuple[list, torch.Tensor]:
    """A fixed non-top-k routing for every fed token, and the response logprobs it gives (plain forward)."""
    n, num_experts = fed_length(sample), model.args.num_experts
    routed = [
        [[(t + layer) % num_experts, (t + layer + 1) % num_experts] for layer in range(2)] for t in range(n)
    ]
    replay = torch.tensor(routed).permute(1, 0, 2)
    ids = torch.tensor(sample.prompt_ids + sample.response_ids[:-1])
    with torch.no_grad():
        out = model.forward_packed(
            ids, torch.arange(n), VarlenAttention([0, n]), RoutingTrace(record=False, replay=replay)
        )
        log_probs = F.log_softmax(model.compute_logits(out.hidden).float(), dim=-1)
    p = len(sample.prompt_ids)
    rows = torch.arange(p - 1, p - 1 + len(sample.response_ids))
    return routed, log_probs[rows].gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)


def test_routing_replay_reproduces_rollout_routing() -> None:
    model = tiny_model(0, std=0.5)
    samples = random_samples(5, seed=6)
    for s in samples:
        s.routed_experts, logprobs = forced_routing(model, s)
        s.rollout_logprobs = logprobs.tolist()
    replayed = make_trainer(model, lr=0.0, routing_replay=True, micro_batch_tokens=16).train_step(samples)
    assert replayed["mismatch/logprob_abs_diff_max"] < 1e-5
    assert replayed["mismatch/kl"] < 1e-9
    natural = make_trainer(model, lr=0.0, routing_replay=False).train_step(samples)
    assert natural["mismatch/logprob_abs_diff_max"] > 1e-3

    samples[0].routed_experts = None
    with pytest.raises(ValueError, match="record_routing"):
        make_trainer(model, lr=0.0, routing_replay=True).train_step(samples)


def test_tis_and_mismatch_metrics_in_train_step() -> None:
    model = tiny_model()
    samples = random_samples(4, seed=7)
    offsets = [1.0, 1.0, -0.5, -0.5]  # trainer logprob minus engine logprob, per sample
    for s, offset, adv in zip(samples, offsets, [1.0, 0.5, -0.5, 2.0]):
        exact, _ = reference_logprobs(model, s)
        s.rollout_logprobs = (exact - offset).tolist()
        s.advantage = adv
    lengths = [len(s.response_ids) for s in samples]
    total = sum(lengths)
    weights = [min(math.exp(d), 2.0) for d in offsets]  # e^1 is capped at 2; e^-0.5 is not
    expected = {
        "mismatch/logprob_abs_diff_mean": sum(abs(d) * n for d, n in zip(offsets, lengths)) / total,
        "mismatch/logprob_abs_diff_max": 1.0,
        "mismatch/kl": sum((math.exp(d) - 1 - d) * n for d, n in zip(offsets, lengths)) / total,
        "mismatch/tis_clipfrac": (lengths[0] + lengths[1]) / total,
        "mismatch/tis_weight_mean": sum(w * n for w, n in zip(weights, lengths)) / total,
        # token_mean PPO loss at ratio 1, each token weighted by its TIS weight
        "train/pg_loss": -sum(s.advantage * w * n for s, w, n in zip(samples, weights, lengths)) / total,
    }
    algorithm = AlgorithmConfig(tis=True, tis_cap=2.0)
    fused = make_trainer(model, lr=0.0, algorithm=algorithm).train_step(samples)
    # two epochs take the separate no-grad pass before updating (lr=0 keeps every epoch identical)
    separate = make_trainer(model, lr=0.0, algorithm=algorithm, epochs_per_rollout=2).train_step(samples)
    for metrics in (fused, separate):
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, abs=1e-5), name


def test_bf16_autocast_and_mfu_against_a_stated_peak() -> None:
    model = tiny_model()
    samples = random_samples(4, seed=8)
    for s in samples:
        s.rollout_logprobs = reference_logprobs(model, s)[0].tolist()
    metrics = make_trainer(model, lr=1e-3, precision="bf16", peak_flops=1e12).train_step(samples)
    assert metrics["mismatch/logprob_abs_diff_mean"] < 0.05
    assert metrics["train/mfu"] > 0
    assert "train/mfu" not in make_trainer(tiny_model(), lr=1e-3).train_step(samples)  # CPU, no stated peak


def test_bad_configuration_fails_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="reference model"):
        make_trainer(tiny_model(), algorithm=AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="token_mean"):
        make_trainer(tiny_model(), algorithm=AlgorithmConfig(loss_agg="mean"))
    with pytest.raises(ValueError, match="fp32, bf16"):
        make_trainer(tiny_model(), precision="fp16")
    with pytest.raises(ValueError, match="trainer.fused_kernels 'yes'; use one of auto, on, off"):
        make_trainer(tiny_model(), fused_kernels="yes")
    assert not make_trainer(tiny_model(), precision="bf16").fused_kernels  # auto: CUDA only
    bad = Sample(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        make_trainer(tiny_model()).train_step([bad])
    with pytest.raises(ValueError, match="temperature > 0"):
        make_trainer(tiny_model(), temperature=0.0).train_step(random_samples(2))


def test_a_failing_compiled_backward_redoes_the_step_eagerly(monkeypatch) -> None:
    # trainer.fused_kernels: a compiled backward is built inside loss.backward(), out of the forward fallback's
    # reach; the step is redone with the eager chains, and the engine's compiled kernels stay on
    from miles.models import fused

    samples = random_samples(6, seed=7)
    for s in samples:
        s.advantage = 1.0 if s.index == 0 else -1.0
    monkeypatch.setattr(fused, "_chains_failed", False)
    eager_model, model = tiny_model(seed=8), tiny_model(seed=8)
    eager = make_trainer(eager_model, fused_kernels="off", lr=1e-2).train_step(copy.deepcopy(samples))
    trainer = make_trainer(model, fused_kernels="on", lr=1e-2)
    original, calls = trainer._accumulate_gradients, []

    def failing_once(*args, **kwargs):
        calls.append(trainer.fused_kernels)
        if len(calls) == 1:
            raise RuntimeError("inductor: backward lowering failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "_accumulate_gradients", failing_once)
    retried = trainer.train_step(copy.deepcopy(samples))
    assert calls == [True, False] and not trainer.fused_kernels
    assert fused._chains_failed and not fused._failed and not fused.compiling()
    assert retried["train/grad_norm"] == eager["train/grad_norm"]
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    # without compiled chains an error is the caller's
    plain = make_trainer(tiny_model())
    monkeypatch.setattr(plain, "_accumulate_gradients", _raise_broken)
    with pytest.raises(RuntimeError, match="broken"):
        plain.train_step(copy.deepcopy(samples))


def _raise_broken(*args, **kwargs):
    raise RuntimeError("broken")


def test_custom_policy_loss_by_dotted_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_pg_plugin.py").write_text(
        "def vanilla_pg(batch, cfg):\n"
        "    from miles.trainer.losses import PolicyLossOutput\n"
        "    return PolicyLossOutput(token_loss=-batch.advantages * batch.logprobs,\n"
        "                            token_metrics={'train/custom_one': batch.loss_mask})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tiny_model()
    samples = random_samples(4, seed=9)
    for s, adv in zip(samples, [1.0, -0.5, 2.0, 0.0]):
        s.advantage = adv
    expected = -sum(s.advantage * reference_logprobs(model, s)[0].sum().item() for s in samples)
    expected /= sum(len(s.response_ids) for s in samples)
    algorithm = AlgorithmConfig(tis=False, policy_loss="my_pg_plugin:vanilla_pg")
    metrics = make_trainer(model, lr=0.0, algorithm=algorithm).train_step(samples)
    assert metrics["train/pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["train/custom_one"] == pytest.approx(1.0)


def test_batched_mismatch_and_tis_metrics_equal_the_per_sample_definition() -> None:
    """The batch-wide computation (one host sync) against the definitions sample by sample: only loss tokens
    of samples with rollout logprobs count; a masked token's extreme ratio changes nothing."""
    from miles.trainer.mismatch import mismatch_metrics, rows_on_device, tis_weights

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 4]
    old = [-torch.rand(n, generator=gen) * 3 for n in lengths]
    rollout: list[torch.Tensor | None] = [o + 0.3 * torch.randn(o.shape, generator=gen) for o in old]
    rollout[2] = None  # a sample the engine gave no logprobs
    masks = rows_on_device([[1.0] * n for n in lengths], torch.device("cpu"))
    masks[0][1] = 0.0
    rollout[0][1] = -200.0  # masked out: its ratio (e^200) must not reach the metrics
    cap = 1.5
    kept = [(o, r, m > 0) for o, r, m in zip(old, rollout, masks) if r is not None]
    diffs = torch.cat([(o - r).abs()[k] for o, r, k in kept])
    kls = torch.cat([kl_estimate(r, o, "k3")[k] for o, r, k in kept])
    ratios = torch.cat([torch.exp(o - r)[k] for o, r, k in kept])
    metrics = mismatch_metrics(old, rollout, masks)
    assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(diffs.mean().item(), rel=1e-6)
    assert metrics["mismatch/logprob_abs_diff_max"] == pytest.approx(diffs.max().item(), rel=1e-6)
    assert metrics["mismatch/kl"] == pytest.approx(kls.mean().item(), rel=1e-5)
    weights, tis = tis_weights(old, rollout, masks, cap)
    assert tis["mismatch/tis_clipfrac"] == pytest.approx((ratios > cap).float().mean().item())
    assert tis["mismatch/tis_weight_mean"] == pytest.approx(ratios.clamp(max=cap).mean().item(), rel=1e-6)
    for o, r, w in zip(old, rollout, weights):
        want = torch.ones_like(o) if r is None else torch.exp(o - r).clamp(max=cap)
        torch.testing.assert_close(w, want)
    assert mismatch_metrics([], [], []) == {} and tis_weights([], [], [], cap) == ([], {})
