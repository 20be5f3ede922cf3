"""`GroupedExperts`: megatron's experts slot filled with stacked expert weights and torch's grouped GEMMs.

megatron-core's own grouped-GEMM experts need Transformer Engine (`TEGroupedMLP`) or the `grouped_gemm`
package (`GroupedMLP`); without them it runs `SequentialMLP`, one MLP module per expert, which on a GPU is
a loop of small GEMMs with a host sync per layer (`tokens_per_expert.tolist()`): 6x slower than one grouped
GEMM per projection on the 30B-A3B shape (docs/benchmarks.md). This module takes the same inputs from
megatron's token dispatcher (tokens already permuted by expert, their router probabilities) and computes
what `SequentialMLP` computes: per expert `fc2(silu(gate) * up * prob)`, the probability applied after the
activation as megatron's MLP applies `per_token_scale`.

Its weights are the engine model's layout (`weight1` [E, 2I, H] is gate then up, `weight2` [E, H, I]), so
the weight sync copies them without stacking. With expert parallelism E is this rank's experts; with expert
tensor parallelism I is this rank's slice of each expert's intermediate dimension (gate and up alike).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import nn


class GroupedExperts(MegatronModule):
    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("GroupedExperts has no expert biases")
        # expert tensor parallelism: each rank holds a slice of every local expert's intermediate dimension;
        # the dispatcher sums the slices' fc2 outputs over those ranks
        hidden, inter = config.hidden_size, config.moe_ffn_hidden_size // _expert_tp_size()
        self.num_local_experts = num_local_experts
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, 2 * inter, hidden))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, hidden, inter))

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **_: Any
    ) -> tuple[torch.Tensor, None]:
        """tokens [T, H] sorted by expert, tokens_per_expert [E], probs [T] -> ([T, H], no bias)."""
        w1, w2, x = self.weight1, self.weight2, tokens
        dtype = _compute_dtype(x)
        if dtype != x.dtype or dtype != w1.dtype:
            x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
        if _grouped_mm_applies(x, w1, w2):
            offsets = torch.cumsum(tokens_per_expert.to(x.device), dim=0, dtype=torch.int32)
            hidden = swiglu_scaled(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets), probs, dtype)
            return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets), None
        outs, start = [], 0
        # unbind once: its backward stacks the experts' gradients, where w[e] would add an [E, ...] tensor each
        for w1_e, w2_e, count in zip(w1.unbind(0), w2.unbind(0), tokens_per_expert.tolist()):
            rows = slice(start, start + count)
            outs.append(F.linear(swiglu_scaled(F.linear(x[rows], w1_e), probs[rows], dtype), w2_e))
            start += count
        return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape), None


def swiglu_scaled(fc1: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(silu(gate) * up * probs[:, None]).to(dtype)` with fc1 = [gate | up] ([T, 2I]) and probs [T].

    The same values and gradients as autograd's chain (the same ops in the same dtypes), but backward keeps
    only fc1 and probs: the chain also saves silu(gate) and silu(gate) * up ([T, I] each, 3 kB per routed
    token on the 30B-A3B shape), and its `chunk` backward concatenates the two halves' gradients."""
    return _SwiGLUScaled.apply(fc1, probs, dtype)


class _SwiGLUScaled(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, fc1: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        gate, up = fc1.chunk(2, dim=-1)
        ctx.save_for_backward(fc1, probs)
        return (F.silu(gate) * up * probs.unsqueeze(-1)).to(dtype)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        fc1, probs = ctx.saved_tensors  # type: ignore[attr-defined]
        gate, up = fc1.chunk(2, dim=-1)
        silu = F.silu(gate)
        act = silu * up
        scale = probs.unsqueeze(-1)
        # each step as autograd differentiates the chain: mul's gradient in the promoted dtype, cast back to
        # its input's; the probability's summed over the broadcast dimension
        grad_scaled = grad_out.to(torch.promote_types(act.dtype, scale.dtype))
        grad_probs = None
        if ctx.needs_input_grad[1]:
            grad_probs = (grad_scaled * act).sum(-1, keepdim=True).squeeze(-1).to(probs.dtype)
        grad_fc1 = None
        if ctx.needs_input_grad[0]:
            grad_act = (grad_scaled * scale).to(act.dtype)
            grad_fc1 = torch.empty_like(fc1)
            inter = gate.shape[-1]
            torch.ops.aten.silu_backward.grad_input(grad_act * up, gate, grad_input=grad_fc1[..., :inter])
            torch.mul(grad_act, silu, out=grad_fc1[..., inter:])
        return grad_fc1, grad_probs, None


def _expert_tp_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_expert_tensor_parallel_world_size()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device (the grouped GEMM is not an autocast op)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch's grouped GEMM: bf16 on CUDA; float types on CPU; rows 16-byte aligned in both cases."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:
        return False
    elem = x.element_size()
    return all((t.shape[-1] * elem) % 16 == 0 for t in (x, w1, w2))
