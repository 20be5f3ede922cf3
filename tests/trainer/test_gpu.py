"""GPU: the trainer's CUDA paths against their reference paths.

The varlen flash attention against the SDPA path in float32, the MoE experts' grouped GEMMs under bf16
autocast against the per-expert loop, and a bf16 update against a float32 one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles.models import VarlenAttention, fused
from miles.models.moe import Experts
from miles.trainer.logprobs import packed_logprobs
from miles.trainer.packing import pack
from tests.support.trainer import make_trainer, random_samples, tiny_model

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _attend(att: VarlenAttention, q, k, v, scale):
    out = att.attend(0, q, k, v, scale)
    grads = torch.autograd.grad(out.float().square().sum(), [q, k, v])
    return out.float(), [g.float() for g in grads]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_varlen_attention_matches_the_sdpa_path(head_dim: int) -> None:
    lens = [1, 7, 130, 64, 300]
    cu = torch.tensor([0, *lens]).cumsum(0).tolist()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hq, hkv = cu[-1], 8, 2
    q, k, v = (
        torch.randn(n, h, head_dim, device=CUDA, generator=gen).requires_grad_(True) for h in (hq, hkv, hkv)
    )
    scale = head_dim**-0.5

    reference = VarlenAttention(cu)
    reference.use_flash = False
    want, want_grads = _attend(reference, q, k, v, scale)  # float32, no autocast

    flash = VarlenAttention(cu)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert flash._flash_dtype(q) == torch.bfloat16  # the flash path runs, not a silent fallback
        got, got_grads = _attend(flash, q, k, v, scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads):
        assert ((g - w).norm() / w.norm()).item() < 2e-2

    half = VarlenAttention(cu)  # fp16 inputs without autocast
    q16, k16, v16 = (x.detach().half().requires_grad_(True) for x in (q, k, v))
    got16, _ = _attend(half, q16, k16, v16, scale)
    torch.testing.assert_close(got16, want, atol=1e-2, rtol=1e-2)


def _update_grads(model, samples, precision: str, fused_kernels: bool = False):
    (batch,) = pack(samples, list(range(len(samples))), 10_000, CUDA)
    model.zero_grad(set_to_none=True)
    lp = packed_logprobs(model, batch, precision=precision, fused_kernels=fused_kernels).logprobs
    lp.sum().backward()
    with torch.no_grad():  # the old / reference logprobs' pass: the training forward's kernels, same bits
        no_grad = packed_logprobs(model, batch, precision=precision, fused_kernels=fused_kernels).logprobs
    assert torch.equal(no_grad, lp.detach())
    return lp.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_moe_grouped_gemm_training_matches_the_expert_loop(monkeypatch) -> None:
    model = tiny_model(seed=1).to(CUDA)
    samples = random_samples(6, seed=2)
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    lp_grouped, grads_grouped = _update_grads(model, samples, "bf16")
    assert calls and set(calls) == {torch.bfloat16}
    calls.clear()
    monkeypatch.setattr(Experts, "_autocast_grouped_dtype", lambda self, x: None)
    lp_loop, grads_loop = _update_grads(model, samples, "bf16")
    assert not calls
    torch.testing.assert_close(lp_grouped, lp_loop, atol=2e-2, rtol=2e-2)
    for name, g in grads_grouped.items():
        w = grads_loop[name]
        assert g.dtype == torch.float32
        assert ((g - w).norm() / w.norm().clamp_min(1e-12)).item() < 3e-2, name


def test_bf16_update_on_cuda_follows_the_float32_one() -> None:
    samples = random_samples(8, seed=4)
    for s in samples:
        s.advantage = 1.0 if s.index == 0 else -1.0
    metrics = {}
    for precision in ("fp32", "bf16"):
        model = copy.deepcopy(tiny_model(seed=3)).to(CUDA)
        trainer = make_trainer(model, precision=precision, lr=1e-3, global_batch_size=len(samples))
        metrics[precision] = trainer.train_step(copy.deepcopy(samples))
    assert metrics["bf16"]["train/grad_norm"] == pytest.approx(metrics["fp32"]["train/grad_norm"], rel=0.05)
    assert metrics["bf16"]["train/loss"] == pytest.approx(metrics["fp32"]["train/loss"], rel=0.05, abs=1e-3)


def test_compiled_elementwise_chains_train_like_the_eager_ones() -> None:
    # trainer.fused_kernels: the norms, residual adds, q/k norm + RoPE and SwiGLU compiled with their
    # backward and none of the engine's hand-written kernels; the same arithmetic, so the same gradients up
    # to the bf16 GEMMs' rounding
    samples = random_samples(8, seed=6)
    model = tiny_model(seed=5).to(CUDA)
    fused._compiled.clear()
    lp_eager, grads_eager = _update_grads(model, samples, "bf16", fused_kernels=False)
    assert not fused._compiled
    lp_fused, grads_fused = _update_grads(model, samples, "bf16", fused_kernels=True)
    assert fused._compiled and not fused._chains_failed and not fused._failed
    torch.testing.assert_close(lp_fused, lp_eager, atol=1e-2, rtol=1e-2)
    for name, g in grads_fused.items():
        w = grads_eager[name]
        assert ((g - w).norm() / w.norm().clamp_min(1e-12)).item() < 2e-2, name

    for s in samples:
        s.advantage = 1.0 if s.index == 0 else -1.0
    trainer = make_trainer(model, precision="bf16", global_batch_size=len(samples))
    assert trainer.fused_kernels  # auto: CUDA and bf16
    trainer.train_step(copy.deepcopy(samples))
    assert trainer.fused_kernels and not fused._chains_failed
