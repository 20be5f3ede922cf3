"""The MoE routers' logits in float32 from the bf16 hidden states, keeping the bf16 input for backward.

`linear(hidden.float(), weight.float())` under autograd saves the float32 copy of the hidden states: 8 kB a
token and MoE layer at hidden 2048, where the bf16 input it was cast from holds the same values in half. This
function saves the input as it arrives and, in the backward, runs the same float32 linear again under
autograd (a [tokens, experts] GEMM, ~1 % of the layer's FLOPs), so values and gradients are autograd's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(hidden.float(), weight.float(), bias.float())` with autocast off; backward keeps `hidden`."""
    return _Float32Logits.apply(hidden, weight, bias)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


class _Float32Logits(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, bias)
        return _logits(hidden, weight, bias)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias = ctx.saved_tensors  # type: ignore[attr-defined]
        inputs = [t.detach().requires_grad_(need) for t, need in zip((hidden, weight), ctx.needs_input_grad)]
        b = None if bias is None else bias.detach().requires_grad_(ctx.needs_input_grad[2])
        wanted = [t for t in (*inputs, b) if t is not None and t.requires_grad]
        with torch.enable_grad():
            logits = _logits(inputs[0], inputs[1], b)
        grads = iter(torch.autograd.grad(logits, wanted, grad)) if wanted else iter(())
        return tuple(next(grads) if t is not None and t.requires_grad else None for t in (*inputs, b))
