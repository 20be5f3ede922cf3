"""The MoE experts' training forward as one autograd Function: gather, expert MLPs, weighted combine.

`Experts.forward` (miles/models/moe.py) runs this where autograd records the forward (the trainer's); the
engine's no-grad forwards keep their own code. Values are those of the autograd chain it replaces (the
same ops in the same dtypes), but backward keeps only the experts' first projection ([pairs, 2I], the
gate and up halves) and the routing, instead of the gathered tokens, silu(gate), silu(gate) * up, the
second projection's output and the weighted output ([pairs, H] three times): backward gathers the tokens
again from x and recomputes silu(gate) * up, two cheap elementwise passes.

The gating weight multiplies the second projection's output, so its gradient is `<d out, y>` for y the
unweighted output. It is computed as `<d out @ W2, h>` (h = silu(gate) * up, y = h @ W2.T), which the
backward's GEMM for d h gives anyway, so y need not be kept; the sum then runs over I instead of H, a
different rounding of the same value (float32: ~1e-7 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models import fused


@dataclass
class ExpertRows:
    """Where each (token, slot) pair's row lies once the pairs are sorted by expert."""

    token_of: torch.Tensor
    """[P] int64: the token of each sorted pair."""
    order: torch.Tensor
    """[P] int64: each sorted pair's flat index (token * k + slot) in the [N, k] routing."""
    counts: torch.Tensor
    """[E] int64: rows per expert."""
    grouped: bool
    """One grouped GEMM per projection (CUDA); else one GEMM per expert."""


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    rows: ExpertRows,
    dtype: torch.dtype,
) -> torch.Tensor:
    """sum over each token's k slots of `weight * down(silu(gate) * up)` for x [N, H], weights [N, k] and the
    stacked experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); the GEMMs and the activation run in
    `dtype` (what autocast gives a linear), the weighting and the sum in x's and the weights' dtype."""
    return _RoutedExperts.apply(x, weights, gate_up_proj, down_proj, rows, dtype)


def _offsets(rows: ExpertRows) -> torch.Tensor:
    return torch.cumsum(rows.counts, dim=0, dtype=torch.int32)


def _per_expert(rows: ExpertRows) -> list[tuple[int, slice]]:
    """(expert, its rows) for the experts that got any (a host sync: the loop needs the counts)."""
    spans, start = [], 0
    for expert, count in enumerate(rows.counts.tolist()):
        if count:
            spans.append((expert, slice(start, start + count)))
        start += count
    return spans


def _project(
    a: torch.Tensor, weight: torch.Tensor, rows: ExpertRows, offsets: torch.Tensor | None
) -> torch.Tensor:
    """a [P, in] @ weight[e].T for each expert's rows (weight [E, out, in]) -> [P, out]."""
    if offsets is not None:
        return torch._grouped_mm(a, weight.transpose(-2, -1), offs=offsets)
    out = a.new_empty(a.shape[0], weight.shape[1])
    for expert, span in _per_expert(rows):
        torch.mm(a[span], weight[expert].t(), out=out[span])  # F.linear's GEMM
    return out


def _project_back(
    grad: torch.Tensor, weight: torch.Tensor, rows: ExpertRows, offsets: torch.Tensor | None
) -> torch.Tensor:
    """grad [P, out] @ weight[e] for each expert's rows -> [P, in]: the gradient of `_project`'s input."""
    if offsets is not None:
        return torch._grouped_mm(grad, weight, offs=offsets)
    out = grad.new_empty(grad.shape[0], weight.shape[2])
    for expert, span in _per_expert(rows):
        torch.mm(grad[span], weight[expert], out=out[span])
    return out


def _weight_grad(
    grad: torch.Tensor, a: torch.Tensor, num_experts: int, rows: ExpertRows, offsets: torch.Tensor | None
) -> torch.Tensor:
    """[E, out, in]: grad[e].T @ a[e] per expert (zero for experts without rows): `_project`'s weight gradient."""
    if offsets is not None:
        return torch._grouped_mm(grad.t(), a, offs=offsets)
    out = grad.new_zeros(num_experts, grad.shape[1], a.shape[1])
    for expert, span in _per_expert(rows):
        torch.mm(grad[span].t(), a[span], out=out[expert])
    return out


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        rows: ExpertRows,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        offsets = _offsets(rows) if rows.grouped else None
        with torch.autocast(x.device.type, enabled=False):  # the casts autocast would make, made explicitly
            xc = x.to(dtype)
            gate_up = _project(xc.index_select(0, rows.token_of), gate_up_proj.to(dtype), rows, offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = fused.call(fused.silu_mul, gate, up) if rows.grouped else F.silu(gate) * up
            out = _project(hidden, down_proj.to(dtype), rows, offsets)
            del hidden
            out = out * weights.reshape(-1).index_select(0, rows.order).unsqueeze(1)
            result = _combine(out, x, rows)
        ctx.save_for_backward(
            xc, weights, gate_up_proj, down_proj, gate_up, rows.token_of, rows.order, rows.counts
        )
        ctx.grouped, ctx.x_dtype = rows.grouped, x.dtype
        return result

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        xc, weights, gate_up_proj, down_proj, gate_up, token_of, order, counts = ctx.saved_tensors  # type: ignore[attr-defined]
        rows = ExpertRows(token_of, order, counts, ctx.grouped)  # type: ignore[attr-defined]
        need_x, need_weights, need_w1, need_w2 = ctx.needs_input_grad[:4]
        dtype, num_experts = gate_up.dtype, gate_up_proj.shape[0]
        offsets = _offsets(rows) if rows.grouped else None
        with torch.autocast(grad.device.type, enabled=False):
            # every pair's output row gets its token's gradient (the combine's backward)
            grad_out = grad.index_select(0, rows.token_of)
            slot_weights = weights.reshape(-1).index_select(0, rows.order).unsqueeze(1)
            gate, up = gate_up.chunk(2, dim=-1)
            silu = F.silu(gate)
            hidden = silu * up
            grad_out_c = grad_out.to(dtype)
            del grad_out
            # d(weight * h @ W2.T) / dh = weight * (d out @ W2); d / d weight = <d out @ W2, h>
            grad_unweighted = _project_back(grad_out_c, down_proj.to(dtype), rows, offsets)
            grad_weights = None
            if need_weights:
                sum_dtype = torch.promote_types(grad.dtype, dtype)
                per_pair = (grad_unweighted.to(sum_dtype) * hidden).sum(-1)
                grad_flat = torch.empty_like(per_pair)
                grad_flat[rows.order] = per_pair
                grad_weights = grad_flat.view(weights.shape).to(weights.dtype)
            grad_w2 = None
            if need_w2:
                weighted = (hidden * slot_weights).to(dtype)
                grad_w2 = _weight_grad(grad_out_c, weighted, num_experts, rows, offsets)
                grad_w2 = grad_w2.to(down_proj.dtype)
                del weighted
            del grad_out_c, hidden
            if not (need_x or need_w1):
                return None, grad_weights, None, grad_w2, None, None
            grad_hidden = (grad_unweighted * slot_weights).to(dtype)
            del grad_unweighted
            # silu(gate) * up differentiated as autograd differentiates it, into one [P, 2I] buffer
            grad_gate_up = torch.empty_like(gate_up)
            inter = gate.shape[-1]
            torch.ops.aten.silu_backward.grad_input(
                grad_hidden * up, gate, grad_input=grad_gate_up[:, :inter]
            )
            torch.mul(grad_hidden, silu, out=grad_gate_up[:, inter:])
            del grad_hidden, silu
            grad_w1 = None
            if need_w1:
                gathered = xc.index_select(0, rows.token_of)  # gathered again rather than kept
                grad_w1 = _weight_grad(grad_gate_up, gathered, num_experts, rows, offsets)
                grad_w1 = grad_w1.to(gate_up_proj.dtype)
                del gathered
            grad_x = None
            if need_x:
                grad_rows = _project_back(grad_gate_up, gate_up_proj.to(dtype), rows, offsets)
                # the gather's backward as indexing's: each token's k rows summed in a fixed order
                grad_x = grad_rows.new_zeros(xc.shape, dtype=ctx.x_dtype)  # type: ignore[attr-defined]
                grad_x.index_put_((rows.token_of,), grad_rows.to(grad_x.dtype), accumulate=True)
        return grad_x, grad_weights, grad_w1, grad_w2, None, None


def _combine(out: torch.Tensor, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """[N, H]: each token's k weighted rows summed, as `Experts.forward` sums them."""
    if x.is_cuda:
        # in slot order through the inverse permutation: index_add_ on CUDA adds with atomics
        slot_of = torch.empty_like(rows.order)
        slot_of[rows.order] = torch.arange(rows.order.numel(), device=rows.order.device)
        n = x.shape[0]
        return out.index_select(0, slot_of).view(n, -1, out.shape[-1]).sum(dim=1)
    result = torch.zeros_like(x)
    result.index_add_(0, rows.token_of, out)
    return result
