"""Qwen3-MoE sparse block: top-k softmax router plus experts stored as stacked tensors.

Experts are kept as `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` (the layout transformers 5 uses
in memory) so a grouped GEMM can run them in one call; checkpoints keep Hugging Face's per-expert names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import fused, fused_moe
from miles.models.args import ModelArgs
from miles.models.routed_experts import ExpertRows, routed_experts


@dataclass
class RoutingTrace:
    """Records the experts each token chose, or replays choices recorded earlier (routing replay).

    `replay[j]` holds the [N, top_k] expert ids for the j-th MoE layer of this forward; gating weights are
    still computed from this forward's router probabilities, renormalised over the replayed experts.
    `valid_rows` ([1] int32 on the device, set by CUDA-graph decode) counts the real rows: the rows after
    them pad the batch to the graph's size, and the fused kernels route them to no expert (recorded as id E)
    instead of computing experts for outputs nobody reads.
    """

    record: bool = True
    replay: list[torch.Tensor] | torch.Tensor | None = None
    recorded: list[torch.Tensor] = field(default_factory=list)
    valid_rows: torch.Tensor | None = None

    def choose(self, moe_index: int, probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, top_k], their router probabilities)."""
        if self.replay is not None:
            chosen = self.replay[moe_index].to(device=probs.device, dtype=torch.long)
            weights = probs.gather(-1, chosen)
        else:
            weights, chosen = torch.topk(probs, top_k, dim=-1)
        if self.record:
            self.recorded.append(chosen)  # integer ids: never part of an autograd graph
        return chosen, weights

    def stacked(self) -> torch.Tensor:
        """[num_moe_layers, N, top_k]."""
        return torch.stack(self.recorded, dim=0)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs, moe_index: int) -> None:
        super().__init__()
        self.moe_index = moe_index
        self.num_experts, self.top_k, self.norm_topk_prob = (
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size)

    def forward(self, x: torch.Tensor, routing: RoutingTrace | None = None) -> torch.Tensor:
        """The layer's output for x: [N, H]."""
        out = self.delta(x, routing)
        return out.sum(dim=1) if out.dim() == 3 else out

    def delta(self, x: torch.Tensor, routing: RoutingTrace | None = None) -> torch.Tensor:
        """The layer's output for x, [N, H], or on the fused path its [N, top_k, H] weighted per-slot
        outputs, for the caller to sum in the kernel that adds them to the residual stream."""
        weights, chosen, padding_unrouted = self.route(self.gate(x), routing, x)
        slots = self.experts.forward_slots(x, chosen, weights)
        if slots is not None:
            return slots
        if padding_unrouted:
            # The fused experts failed after the fused router ran: give padding rows a real expert.
            chosen = chosen.clamp(max=self.num_experts - 1)
        return self.experts(x, chosen, weights)

    def route(
        self, router_logits: torch.Tensor, routing: RoutingTrace | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(gating weights [N, k] in x's dtype, expert ids [N, k], whether padding rows got id E: the fused
        router with `routing.valid_rows` set)."""
        if (routing is None or routing.replay is None) and self.experts.fused(x, x.shape[0] * self.top_k):
            valid = routing.valid_rows if routing is not None else None
            # None: the kernel failed (Triton cannot compile here); the eager router computes the same.
            routed = fused_moe.kernels.run(
                fused_moe.route, router_logits, self.top_k, self.norm_topk_prob, x.dtype, valid_rows=valid
            )
            if routed is not None:
                weights, chosen = routed
                if routing is not None and routing.record:
                    routing.recorded.append(chosen)
                return weights, chosen, valid is not None
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        if routing is None:
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        else:
            chosen, weights = routing.choose(self.moe_index, probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if weights.dtype == x.dtype else weights.to(x.dtype)), chosen, False


_NARROW_SORT_MIN = 16384
"""On CPU, from this many (token, slot) pairs the expert ids sort as int16 (measured: 4,096 ids sort ~15 % faster
as int64, 65,536 ~5x faster as int16)."""

# Above this many (token, slot) pairs per expert the GEMMs turn compute-bound (prefill), where the grouped
# GEMM is the better kernel; below it the fused Triton kernels read the weights faster (`miles bench moe`).
FUSED_MAX_PAIRS_PER_EXPERT = 128


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.batch_invariant_block = 0
        """> 0: run each expert's tokens in fixed blocks of this many rows (padded), so a token's result does
        not depend on how many other tokens chose the same expert (the engine's deterministic mode)."""

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; chosen/weights: [N, k]. Tokens are sorted by expert so each expert sees one slice.
        (The fused Triton path is `forward_slots`, which `SparseMoeBlock` tries first.)"""
        n, k = chosen.shape
        flat_expert = chosen.reshape(-1)
        # A radix sort makes one pass per key byte: int16 ids sort in 2 passes instead of int64's 8 (on CPU a
        # decode step's few hundred sort faster as they are, without the conversion).
        narrow = (
            flat_expert.to(torch.int16)
            if (x.is_cuda or flat_expert.numel() >= _NARROW_SORT_MIN)
            and self.num_experts <= torch.iinfo(torch.int16).max
            else flat_expert
        )
        sorted_ids, order = torch.sort(narrow, stable=True)
        token_of = order // k
        if self._records_gradients(x, weights):
            grouped, dtype = self._training_gemms(x)
            rows = ExpertRows(token_of, order, self._counts(flat_expert), grouped)
            return routed_experts(x, weights, self.gate_up_proj, self.down_proj, rows, dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            # Indexing's backward sums each token's k copies in a fixed order; index_select's uses atomics.
            sorted_x = x[token_of]
        else:
            sorted_x = x.index_select(0, token_of)  # a plain row gather, faster than generic indexing
        if self.batch_invariant_block:
            out = self._blocked(sorted_x, self._counts(flat_expert), self.batch_invariant_block)
        elif (train_dtype := self._autocast_grouped_dtype(x)) is not None:
            offsets = torch.cumsum(self._counts(flat_expert), dim=0, dtype=torch.int32)
            out = self._grouped(sorted_x.to(train_dtype), offsets, train_dtype)
        elif self._groupable(x):
            if x.is_cuda:
                offsets = torch.cumsum(self._counts(flat_expert), dim=0, dtype=torch.int32)
            else:  # the end of each expert's rows, read off the sorted ids (fewer small ops than counting)
                ends = torch.arange(1, self.num_experts + 1, dtype=sorted_ids.dtype)
                offsets = torch.searchsorted(sorted_ids, ends, out_int32=True)
            out = self._grouped(sorted_x, offsets)
        else:
            out = self._looped(sorted_x, self._counts(flat_expert))
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        if x.is_cuda:
            # index_add_ on CUDA adds with atomics (run-to-run varying order): sum each token's k outputs in
            # slot order instead, gathering rows back through the inverse permutation (a gather is cheaper
            # than scattering the rows).
            slot_of = torch.empty_like(order)
            slot_of[order] = torch.arange(order.numel(), device=order.device)
            return out.index_select(0, slot_of).view(n, k, -1).sum(dim=1)
        result = torch.zeros_like(x)
        result.index_add_(0, token_of, out)
        return result

    def forward_slots(
        self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """[N, k, H] weighted outputs per slot from the fused kernels, or None where they do not apply."""
        if not self.fused(x, chosen.numel()):
            return None
        # None also where the kernels fail: the grouped GEMMs compute the same function.
        return fused_moe.kernels.run(
            fused_moe.experts_forward, x, self.gate_up_proj, self.down_proj, chosen, weights, sum_slots=False
        )

    def fused(self, x: torch.Tensor, num_pairs: int) -> bool:
        """The engine's decode-sized forwards on CUDA (inside `fused_kernels()`; not the trainer's, whose forwards
        need gradients, or the training forward's kernels for their no-grad passes)."""
        return (
            fused.enabled()
            and fused_moe.available()
            and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and not self.batch_invariant_block
            and not torch.is_grad_enabled()  # any parameter may want a gradient
            and num_pairs <= FUSED_MAX_PAIRS_PER_EXPERT * self.num_experts
        )

    def _records_gradients(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """Whether this forward is a training forward: autograd records it and something wants a gradient
        (then `routed_experts` runs it, keeping less for backward than the ops below would)."""
        if not torch.is_grad_enabled() or self.batch_invariant_block:
            return False
        return any(t.requires_grad for t in (x, weights, self.gate_up_proj, self.down_proj))

    def _training_gemms(self, x: torch.Tensor) -> tuple[bool, torch.dtype]:
        """(grouped GEMMs or one per expert, their dtype) for a training forward: the grouped GEMMs on CUDA in
        bf16 (`_autocast_grouped_dtype`, `_groupable`), else a linear per expert in the dtype autocast gives it."""
        if (dtype := self._autocast_grouped_dtype(x)) is not None:
            return True, dtype
        if self._groupable(x):
            return True, x.dtype
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype != torch.float64:
            return False, torch.get_autocast_dtype(device)
        return False, x.dtype

    def _groupable(self, x: torch.Tensor) -> bool:
        """Whether `_grouped` runs here: bf16 on CUDA; on CPU float32/bf16/fp16 without autograd (the engine's
        forwards: one call per projection instead of ~10 ops per expert), with 16-byte-aligned rows."""
        if not hasattr(torch, "_grouped_mm"):
            return False
        if x.is_cuda:
            return x.dtype == torch.bfloat16
        elem = x.element_size()
        return (
            x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled()
            and (x.shape[-1] * elem) % 16 == 0
            and (self.intermediate_size * elem) % 16 == 0
        )

    def _autocast_grouped_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """bf16 when a CUDA forward runs under bf16 autocast (the trainer's, with or without gradients: the old
        and reference logprobs take the training forward's kernels): its float32 activations and master
        weights then go through the grouped GEMMs in bf16, what autocast does for every other linear, and
        their backward computes each projection's expert gradients at once."""
        if not (hasattr(torch, "_grouped_mm") and x.is_cuda):
            return None
        if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") != torch.bfloat16:
            return None
        rows = (x.shape[-1], self.intermediate_size)  # the grouped GEMM wants 16-byte-aligned rows
        if any((n * torch.bfloat16.itemsize) % 16 for n in rows):
            return None
        return torch.bfloat16

    def _blocked(self, sorted_x: torch.Tensor, counts: torch.Tensor, block: int) -> torch.Tensor:
        outs = []
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            xs = F.pad(sorted_x[start : start + count], (0, 0, 0, (-count) % block))
            ys = []
            for b in range(0, xs.shape[0], block):
                gate, up = F.linear(xs[b : b + block], self.gate_up_proj[expert]).chunk(2, dim=-1)
                ys.append(F.linear(F.silu(gate) * up, self.down_proj[expert]))
            outs.append(torch.cat(ys)[:count])
            start += count
        if not outs:
            return sorted_x.new_zeros(sorted_x.shape)
        return torch.cat(outs, dim=0)

    def _looped(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        # One unbind per projection: its backward stacks the experts' gradients once, where indexing
        # `proj[expert]` would add a whole [E, ...] zero-filled gradient per expert (E^2 work).
        gate_ups, downs = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            xs = sorted_x[start : start + count]
            gate, up = F.linear(xs, gate_ups[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, downs[expert]))
            start += count
        if not outs:
            return sorted_x.new_zeros(sorted_x.shape)
        return torch.cat(outs, dim=0)

    def _counts(self, flat_expert: torch.Tensor) -> torch.Tensor:
        """[E] int64 rows per expert."""
        if (
            flat_expert.is_cuda
        ):  # bincount reads its max back to the host; scatter_add keeps the step sync-free
            counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat_expert.device)
            return counts.scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        return torch.bincount(flat_expert, minlength=self.num_experts)

    def _grouped(
        self, sorted_x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """One grouped GEMM per projection over all experts; `offsets` [E] int32 (the cumulative rows per
        expert) stay on the device: no host sync. `dtype` casts the stacked weights first (training)."""
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        if dtype is not None:
            gate_up_proj, down_proj = gate_up_proj.to(dtype), down_proj.to(dtype)
        gate_up = torch._grouped_mm(sorted_x, gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = fused.call(fused.silu_mul, gate, up)
        return torch._grouped_mm(hidden, down_proj.transpose(-2, -1), offs=offsets)
