"""Chunked logprobs: values and gradients equal plain autograd through full [rows, vocab] logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.trainer.logit_gradient import add_weight_gradient
from miles.trainer.logprobs import chunk_rows, chunked_logprobs


def reference(hidden, weight, targets, temperature):
    log_q = F.log_softmax(F.linear(hidden, weight).float() / temperature, dim=-1)
    return log_q.gather(-1, targets[:, None]).squeeze(-1), -(log_q.exp() * log_q).sum(-1)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_full_logits(temperature: float, entropy_grad: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, dim, vocab = 11, 8, 37
    hidden = torch.randn(rows, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    g_lp, g_ent = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)

    lp, ent = chunked_logprobs(hidden, weight, targets, temperature, True, entropy_grad, rows_per_chunk=4)
    ref_lp, ref_ent = reference(hidden, weight, targets, temperature)
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(ent, ref_ent.float())
    assert ent.requires_grad == entropy_grad

    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, [hidden, weight])
    ref_loss = (ref_lp * g_lp.double()).sum() + ((ref_ent * g_ent.double()).sum() if entropy_grad else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, [hidden, weight])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_entropy_is_optional_and_no_grad_mode_works() -> None:
    hidden, weight = torch.randn(5, 4), torch.randn(9, 4)
    targets = torch.tensor([0, 8, 3, 3, 1])
    lp, ent = chunked_logprobs(hidden, weight, targets)
    assert ent is None and lp.shape == (5,)
    with torch.no_grad():
        lp2, _ = chunked_logprobs(hidden, weight, targets, rows_per_chunk=2)
    torch.testing.assert_close(lp, lp2)


def test_a_large_vocabulary_is_split_into_chunks() -> None:
    assert chunk_rows(101) > 100_000  # the tiny models: one chunk
    assert 100 < chunk_rows(151_936) < 1_000  # Qwen3 on CPU: about 256 MiB of float32 logits per chunk
    assert 800 < chunk_rows(151_936, device=torch.device("cuda")) < 1_000  # 512 MiB on CUDA


def test_bit_identical_to_the_plain_formula_and_a_frozen_head_gets_no_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(40, 8, generator=gen)  # frozen (requires_grad False)
    targets = torch.randint(0, 40, (6,), generator=gen)
    lp, _ = chunked_logprobs(hidden, weight, targets, temperature=0.7)
    ref_lp, _ = reference(hidden, weight, targets, 0.7)
    assert torch.equal(lp, ref_lp)  # logits / T, as the engine's sampler computes them
    (grad,) = torch.autograd.grad(lp.sum(), [hidden])
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), [hidden])
    torch.testing.assert_close(grad, ref_grad)


def test_bf16_hidden_runs_the_gemms_in_bf16_against_a_float32_master_weight() -> None:
    # the bf16 trainer's LM head: bf16 operands (the engine's rounding of its logits), float32 softmax, and a
    # float32 gradient for the float32 master weight
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 16, generator=gen).bfloat16().requires_grad_(True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=gen)
    lp, _ = chunked_logprobs(hidden, weight, targets, rows_per_chunk=4)
    ref_lp, _ = reference(hidden, weight.bfloat16(), targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0)
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    h_ref = hidden.detach().clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    reference(h_ref, w_ref.bfloat16(), targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(hidden.grad.float(), h_ref.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad, w_ref.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("temperature, with_entropy", [(1.0, False), (0.7, True)])
def test_the_logprob_path_holds_two_float32_chunks_of_the_vocabulary_at_once(
    temperature: float, with_entropy: bool
) -> None:
    """Measured, not estimated: `miles.bench.vocab_buffers.measure` runs the forward and backward under a
    TorchDispatchMode that sees every tensor each aten op returns, counts the storages of those whose last
    dimension is the vocabulary while any tensor on them is alive (released through weakref finalizers),
    and reports the peak in float32 [chunk rows, vocab] units. Two at most: the logits and log q while
    log_softmax runs, then log q and q (the gradient is computed in q's buffer); the peak is set by the
    chunk's rows, never by the number of rows (no [rows, vocab] logits kept for autograd)."""
    from miles.bench.vocab_buffers import measure

    few, many = (
        measure(n, 4099, 8, rows_per_chunk=32, temperature=temperature, with_entropy=with_entropy)
        for n in (96, 384)
    )
    assert few.peak_bytes == many.peak_bytes
    assert many.float32_chunk_copies == 2.0


def test_the_weight_gradient_adds_each_chunk_into_the_float32_sum() -> None:
    gen = torch.Generator().manual_seed(7)
    grad, hidden = torch.randn(12, 30, generator=gen), torch.randn(12, 8, generator=gen)
    total = torch.zeros(30, 8)
    for s in (0, 5):
        add_weight_gradient(total, grad[s : s + 5], hidden[s : s + 5])
    add_weight_gradient(total, grad[10:], hidden[10:])
    torch.testing.assert_close(total, grad.t() @ hidden)
    bf16 = torch.zeros(30, 8)  # CPU has no mixed-dtype GEMM: the bf16 product, added in float32
    add_weight_gradient(bf16, grad.bfloat16(), hidden.bfloat16())
    assert torch.equal(bf16, (grad.bfloat16().t() @ hidden.bfloat16()).float())


@pytest.mark.gpu
def test_on_cuda_bf16_chunks_add_into_the_float32_sum_in_one_gemm() -> None:
    """The float32 sum is written in place, and with one rounding fewer a chunk than a bf16 product added in
    float32 it is at least as close to the float64 result."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(2048, 1000, generator=gen, device="cuda").bfloat16()
    hidden = torch.randn(2048, 256, generator=gen, device="cuda").bfloat16()
    total = torch.zeros(1000, 256, device="cuda")
    address = total.data_ptr()
    rounded = torch.zeros_like(total)
    for s in range(0, 2048, 256):
        add_weight_gradient(total, grad[s : s + 256], hidden[s : s + 256])
        rounded += (grad[s : s + 256].t() @ hidden[s : s + 256]).float()
    assert total.data_ptr() == address
    exact = grad.double().t() @ hidden.double()
    error, rounded_error = ((t.double() - exact).abs().max().item() for t in (total, rounded))
    assert error <= rounded_error and error < 1e-3 * exact.abs().max().item()
