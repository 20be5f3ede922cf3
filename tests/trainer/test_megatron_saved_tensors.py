"""What backward keeps in the megatron MoE layer (miles/bench/saved_tensors.py), the experts' SwiGLU that
keeps less than autograd's chain with the same values and gradients, and the chunked gradient squares."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from miles.bench.saved_tensors import measure
from miles.models.presets import build_random_model, preset_args
from miles.trainer.distributed_optimizer.grad_squares import sum_of_squares
from miles.trainer.megatron.experts import swiglu_scaled

pytest.importorskip("megatron.core")

# The Qwen3-30B-A3B layer scaled down (top-k of many narrow experts, GQA, q/k norm), 2 layers.
HIDDEN, TOP_K, INTER, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 48, 4, 2, 32


def _scaled_moe_policy():
    from miles.trainer.megatron.policy import MegatronPolicy

    args = replace(
        preset_args(None, "qwen3-30b-a3b", vocab_size=256),
        num_hidden_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=16,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
    )
    return MegatronPolicy.from_model(build_random_model(args, "bfloat16", "cpu", seed=0))


def test_megatron_moe_layer_keeps_at_most_the_audited_bytes_per_token() -> None:
    result = measure(_scaled_moe_policy(), tokens=64, seq_len=32)
    by_file: dict[str, float] = {}
    for (_, where), b in result.layer.items():
        by_file[where.split(":")[0]] = by_file.get(where.split(":")[0], 0.0) + b
    # the experts keep their permuted input, fc1's output and the activation (bf16), and the probabilities
    assert by_file["trainer/megatron/experts.py"] == TOP_K * (2 * (HIDDEN + 2 * INTER + INTER) + 4)
    # the router keeps its bf16 input, not a float32 copy
    assert by_file["trainer/megatron/gating.py"] == 2 * HIDDEN
    # the whole layer without the CPU-only attention softmax, audited: 6,992 bytes a token at this shape
    # (megatron's norms' float32 CPU path included); a tensor kept twice or in float32 where bf16 is computed exceeds it
    kept = sum(b for (_, where), b in result.layer.items() if where != "attention core (CPU path)")
    assert kept <= 6992, sorted(result.layer.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize(
    "dtype,probs_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
)
def test_swiglu_scaled_equals_autograds_chain_bit_for_bit(
    dtype: torch.dtype, probs_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(37, 24, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(37, generator=gen).to(probs_dtype).requires_grad_()
    grad_out = torch.randn(37, 12, generator=gen).to(dtype)
    gate, up = fc1.chunk(2, dim=-1)
    chain = (F.silu(gate) * up * probs.unsqueeze(-1)).to(dtype)
    fused = swiglu_scaled(fc1, probs, dtype)
    assert torch.equal(chain, fused)
    for a, b in zip(
        torch.autograd.grad(chain, [fc1, probs], grad_out), torch.autograd.grad(fused, [fc1, probs], grad_out)
    ):
        assert torch.equal(a, b)


def test_sum_of_squares_in_chunks_equals_the_whole_float64_sum() -> None:
    grad = torch.randn(1000, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = grad.double().square().sum()
    assert torch.equal(sum_of_squares(grad), whole)  # one chunk: the same sum
    chunked = sum_of_squares(grad, chunk=333)
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(chunked, whole, rtol=1e-14, atol=0)
