"""What `PolicyTrainer` does differently for a policy split over ranks (megatron's tensor, expert and
expert-tensor parallelism): which ranks a gradient sums over, the gradient norm of a split model, and
micro-batches in lockstep where every forward is a collective across ranks that hold different samples.

A policy says how each parameter is split through `gradient_groups(name) -> (sum group, parts group)` (see
`MegatronPolicy.gradient_groups`); one without it (our `CausalLM`) is whole on every rank. A sharded optimizer
must follow the same rule: a gradient sums over its own data-parallel group (an expert weight's is the
expert-data-parallel group, not the dense one), and a split parameter's squared norm sums over its parts group.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from miles.distributed import DataParallel
from miles.trainer.distributed_optimizer.grad_squares import sum_of_squares
from miles.trainer.packing import MicroBatch


def gradient_sets(
    model: Any, named: list[tuple[str, torch.Tensor]], dense: DataParallel, world: DataParallel
) -> list[tuple[DataParallel, list[torch.Tensor]]]:
    """The optimizer's tensors grouped by the ranks their gradients sum over: `dense` (the replicas) for
    most, and for a megatron policy's expert weights its expert-data-parallel group (always listed, so every
    rank runs the same collectives)."""
    if getattr(model, "expert_group", None) is None:
        return [(dense, [t for _, t in named])]
    experts = world.within(model.expert_data_parallel_group)
    sets: dict[str, list[torch.Tensor]] = {"dense": [], "experts": []}
    for name, tensor in named:
        group, _ = model.gradient_groups(name)
        sets["experts" if group is model.expert_data_parallel_group else "dense"].append(tensor)
    return [(dense, sets["dense"]), (experts, sets["experts"])]


def clip_split_gradients(
    model: Any, named_grads: list[tuple[str, torch.Tensor]], max_norm: float, device: torch.device
) -> float:
    """`clip_grad_norm_` over the whole model: a split parameter's squared norm summed over the ranks that hold
    its parts (TP, or EP x expert-TP), a whole one (equal on those ranks) counted once."""
    import torch.distributed as dist

    groups = [g for g in (model.tensor_parallel_group, getattr(model, "expert_group", None)) if g is not None]
    split: list[list[torch.Tensor]] = [[] for _ in groups]
    whole: list[torch.Tensor] = []
    for name, grad in named_grads:
        _, parts = model.gradient_groups(name)
        if parts is None:
            whole.append(grad)
        else:
            split[next(i for i, g in enumerate(groups) if g is parts)].append(grad)
    squares = torch.zeros(len(groups) + 1, dtype=torch.float64, device=device)
    for i, grads in enumerate([*split, whole]):
        if grads:
            squares[i] = sum(sum_of_squares(g) for g in grads)
    for i, group in enumerate(groups):  # every rank, every group, in one order
        dist.all_reduce(squares[i : i + 1], group=group)
    total = squares.sum().sqrt().item()
    coef = max_norm / (total + 1e-6)
    if coef < 1.0 and math.isfinite(total):
        for grads in [*split, whole]:
            if grads:
                torch._foreach_mul_(grads, coef)
    return total


def lockstep_batches(
    model: Any, batches: list[MicroBatch], world: DataParallel, device: torch.device, replay: bool
) -> list[MicroBatch]:
    """`batches` padded with filler micro-batches to the most any rank runs, when the policy's forward is a
    collective across ranks holding different samples (`model.lockstep`: the experts' all-to-all); else
    unchanged. A filler (`is_filler`) is one token with no sample: its forward and backward take this rank's
    part in the collectives and contribute nothing."""
    if not getattr(model, "lockstep", False) or not world.enabled:
        return batches
    most = int(world.all_reduce_floats([len(batches)], "max")[0])
    return batches + [_filler(model, device, replay) for _ in range(most - len(batches))]


def is_filler(batch: MicroBatch) -> bool:
    return not batch.sample_ids


def _filler(model: Any, device: torch.device, replay: bool) -> MicroBatch:
    one = torch.zeros(1, dtype=torch.long, device=device)
    args = model.args
    layers = sum(args.is_moe_layer(layer) for layer in range(args.num_hidden_layers))
    routes = torch.arange(args.num_experts_per_tok, device=device).expand(layers, 1, -1) if replay else None
    return MicroBatch(
        sample_ids=[],
        input_ids=one,
        positions=one,
        cu_seqlens=[0, 1],
        target_rows=one,
        targets=one,
        seq_index=one,
        response_lengths=[],
        routing_replay=routes,
    )
