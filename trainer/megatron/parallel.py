"""Megatron's expert parallelism, expert tensor parallelism and tensor parallelism of MoE layers, and routing
replay on megatron's routers: the pieces `MegatronPolicy` installs on megatron-core's own modules.

* **Layout.** `ParallelSizes` (TP, EP, expert-TP) and `check_parallel_sizes`: the combinations megatron's
  process groups can make of the world, checked at start with what to set instead.
* **Experts over ranks.** Megatron's all-to-all token dispatcher sends each token to the EP rank holding its
  expert (and all-gathers them over the expert-TP ranks, each of which holds a slice of every local expert's
  intermediate dimension). Its collectives are megatron's; on a CPU (gloo, the tests) two host-only spots
  are replaced: `install_cpu_collectives`.
* **MoE layers under TP.** Without sequence parallelism every TP rank holds all tokens. Each MoE layer takes
  this rank's slice of them (padded to split evenly) and gathers the outputs back (`split_moe_over_tp`), so
  the experts see each token once: the expert weights' gradients need no correction, and the router's is
  each rank's share (summed over TP, layout.tp_partial_gradient).
* **Routing replay.** `install_routing`: each router takes the experts the engine chose at rollout when a
  replay is set (its gating weights still this forward's softmax, renormalised over them as Qwen3-MoE does),
  and records what it used.

Gradients: a dense parameter sums over megatron's data-parallel group, an expert weight over the expert-data-
parallel group (the ranks holding the same experts); `MegatronPolicy.gradient_groups` says which, per name.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles.errors import MilesUserError
from miles.models import ModelArgs


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    """Ranks splitting attention, dense MLPs and the vocabulary (trainer.tensor_parallel_size)."""
    expert: int = 1
    """Ranks splitting the experts of each MoE layer (trainer.expert_parallel_size)."""
    expert_tensor: int | None = None
    """Ranks splitting each expert's intermediate dimension (trainer.expert_tensor_parallel_size; None: the
    tensor-parallel size, megatron's default)."""

    @property
    def etp(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def experts_split(self) -> bool:
        """Whether expert weights are split over ranks (their gather, checkpoint and gradient groups differ)."""
        return self.expert * self.etp > 1


def check_parallel_sizes(args: ModelArgs, world: int, sizes: ParallelSizes) -> None:
    """The layouts megatron's groups can make: each size divides the world and the model's dimensions."""
    tp, ep, etp = sizes.tensor, sizes.expert, sizes.etp
    for key, value in (
        ("trainer.tensor_parallel_size", tp),
        ("trainer.expert_parallel_size", ep),
        ("trainer.expert_tensor_parallel_size", etp),
    ):
        if value < 1:
            raise MilesUserError(f"{key}={value} must be at least 1")
    if world % tp:
        raise MilesUserError(
            f"trainer.tensor_parallel_size={tp} must divide the {world} processes (placement.num_processes)"
        )
    if (ep > 1 or etp > 1) and not args.num_experts:
        raise MilesUserError(
            "trainer.expert_parallel_size and trainer.expert_tensor_parallel_size split MoE experts; this model "
            "is dense: leave them at 1"
        )
    if world % (ep * etp):
        raise MilesUserError(
            f"trainer.expert_parallel_size={ep} x trainer.expert_tensor_parallel_size={etp} must divide the "
            f"{world} processes (placement.num_processes); pick sizes whose product divides it"
        )
    if args.num_experts and args.num_experts % ep:
        raise MilesUserError(
            f"trainer.expert_parallel_size={ep} must divide the model's {args.num_experts} experts"
        )
    if args.num_experts and args.moe_intermediate_size % etp:
        raise MilesUserError(
            f"trainer.expert_tensor_parallel_size={etp} must divide the experts' intermediate size "
            f"{args.moe_intermediate_size}"
        )


# ---- megatron's collectives on a CPU -------------------------------------------------------------------


def install_cpu_collectives(device: torch.device, sizes: ParallelSizes) -> None:
    """Megatron's all-to-all and sequence gathers allocate their outputs on `torch.cuda.current_device()`;
    in a process without CUDA (where that call can only fail) it names the CPU instead, so the same
    dispatcher runs over gloo. A CPU model in a process that sees a GPU is refused."""
    if device.type != "cpu" or not (sizes.experts_split or sizes.tensor > 1):
        return
    if torch.cuda.is_available():
        raise MilesUserError(
            "expert or tensor parallelism of a MoE model on CPU runs in processes without CUDA (megatron's "
            "collectives allocate on the current GPU otherwise): use model.device=cuda, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=)"
        )
    if sizes.etp > 1 and (sizes.expert > 1 or sizes.etp != sizes.tensor):
        # the expert-TP ranks then hold different numbers of tokens, which megatron all-gathers unevenly
        raise MilesUserError(
            f"trainer.expert_tensor_parallel_size={sizes.etp} on CPU needs trainer.expert_parallel_size=1 and "
            "trainer.tensor_parallel_size equal to it (gloo has no all-gather of uneven parts); use "
            "model.device=cuda, or trainer.expert_tensor_parallel_size=1"
        )
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def build_alltoall_dispatcher_on_cpu(build: Callable[[], Any]) -> Any:
    """Run `build` (megatron's layer construction) with the all-to-all dispatcher's CUDA side stream, which it
    creates once per process, stood in for by a placeholder that `cpu_dispatcher` makes it never use."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not hasattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream"):
        return build()
    saved = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved or object()
    try:
        return build()
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved


def cpu_dispatcher(dispatcher: Any) -> None:
    """The all-to-all dispatcher's device-to-host point (copies on its CUDA stream) done on the host: the
    split sizes become the host arrays its collectives take, as its own copy makes them on a GPU."""
    if not hasattr(dispatcher, "_maybe_dtoh_and_synchronize"):
        raise RuntimeError("this megatron-core's all-to-all dispatcher has no host-copy point to replace")

    def host_splits(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    dispatcher._maybe_dtoh_and_synchronize = types.MethodType(host_splits, dispatcher)


# ---- MoE layers under tensor parallelism ---------------------------------------------------------------


@dataclass
class TokenSlice:
    """The packed rows [start, stop) an MoE layer runs on (stop may pass the batch: zero padding rows)."""

    start: int
    stop: int


def split_moe_over_tp(moe: Any, group: Any, state: Any) -> None:
    """Run MoE layer `moe` on this TP rank's slice of the tokens: every TP rank holds all of them (no sequence
    parallelism), so the slice's outputs are gathered back. Scatter's backward all-gathers the input
    gradient; the gather's backward takes this rank's slice of the (whole, equal on every rank) gradient."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    size, rank = group.size(), group.rank()
    forward = moe.forward
    # The layer does run on a sequence slice: megatron's refusal of TP without sequence parallelism reads this.
    moe.config = copy.copy(moe.config)
    moe.config.sequence_parallel = True

    def sliced(self: Any, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("padding_mask") is not None:  # the policy packs without padding: none to slice along
            raise RuntimeError("an MoE layer split over TP takes no padding_mask")
        rows = hidden.shape[0]
        pad = -rows % size
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, *hidden.shape[1:])])
        chunk = (rows + pad) // size
        state.token_slice = TokenSlice(rank * chunk, (rank + 1) * chunk)
        before = set(state.recorded or ())
        try:
            out, bias = forward(scatter_to_sequence_parallel_region(hidden, group=group), *args, **kwargs)
        finally:
            state.token_slice = None
        for index in set(state.recorded or ()) - before:  # this layer's routes: every rank's slice
            parts = [torch.empty_like(state.recorded[index]) for _ in range(size)]  # type: ignore[index]
            torch.distributed.all_gather(parts, state.recorded[index], group=group)  # type: ignore[index]
            state.recorded[index] = torch.cat(parts)[:rows]  # type: ignore[index]
        whole = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=group)
        return whole[:rows], bias

    moe.forward = types.MethodType(sliced, moe)


# ---- routing replay ------------------------------------------------------------------------------------


@dataclass
class RoutingState:
    """The routing of the forward in progress: experts to replay, routes recorded, the token slice."""

    replay: torch.Tensor | list[torch.Tensor] | None = None
    """[num_moe_layers, N, top_k] expert ids for the packed tokens (None: the routers choose)."""
    recorded: dict[int, torch.Tensor] | None = None
    """MoE layer index -> [rows, top_k] expert ids used (ascending per token), when recording."""
    token_slice: TokenSlice | None = None


def install_routing(router: Any, moe_index: int, args: ModelArgs, state: RoutingState) -> None:
    """Replace `router.routing` (logits [T, E] -> probs [T, E], routing map [T, E]) by one that replays the
    state's experts when set, else runs megatron's own; both record the experts used when asked."""
    own = router.routing
    top_k = args.num_experts_per_tok

    def routing(
        self: Any, logits: torch.Tensor, *rest: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.view(-1, args.num_experts)
        if state.replay is None:
            probs, routing_map = own(logits, *rest, **kwargs)
        else:
            chosen = _replayed_rows(state, moe_index, logits.shape[0], top_k).to(logits.device)
            scores = torch.softmax(logits.float(), dim=-1)
            weights = scores.gather(1, chosen)
            if args.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            probs = torch.zeros_like(scores).scatter(1, chosen, weights).to(logits.dtype)
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
        if state.recorded is not None:
            # exactly top_k experts per token: their ids in ascending order
            state.recorded[moe_index] = routing_map.nonzero()[:, 1].view(-1, top_k)
        return probs, routing_map

    router.routing = types.MethodType(routing, router)


def _replayed_rows(state: RoutingState, moe_index: int, rows: int, top_k: int) -> torch.Tensor:
    """The replayed experts of the rows this layer runs on; padding rows (zeros) get experts 0..k-1."""
    layer = state.replay[moe_index]  # type: ignore[index]
    start, stop = (
        (0, layer.shape[0])
        if state.token_slice is None
        else (state.token_slice.start, state.token_slice.stop)
    )
    mine = layer[start : min(stop, layer.shape[0])].long()
    pad = rows - mine.shape[0]
    if pad < 0 or stop - start != rows:
        raise RuntimeError(f"routing replay has rows [{start}, {stop}) for a router of {rows} tokens")
    if pad:
        mine = torch.cat([mine, torch.arange(top_k, device=mine.device).expand(pad, top_k)])
    return mine


def moe_layer_indices(args: ModelArgs) -> dict[int, int]:
    """Layer (from 0) -> index among the MoE layers (the routing tensors' first dimension)."""
    moe = [layer for layer in range(args.num_hidden_layers) if args.is_moe_layer(layer)]
    return {layer: index for index, layer in enumerate(moe)}
