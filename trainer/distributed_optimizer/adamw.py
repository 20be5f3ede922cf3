"""A distributed (sharded) AdamW over the data-parallel ranks (`trainer.distributed_optimizer`): ZeRO-1/2.

Without it every data-parallel rank holds, beside its weights, float32 masters, two float32 AdamW moments and
the summed gradients of every parameter: about 16 bytes a parameter. Here the trainable parameters are laid
out in flat buckets (one per reduction group, dtype and weight-decay class, in parameter order) and each rank
owns one contiguous 1/N slice of every bucket:
  - micro-batch gradients are summed in float32 into the bucket's flat gradient buffer as autograd produces
    them (the parameter's own gradient is then dropped), as `MasterWeights` sums them per tensor;
  - before the update the buffer is reduce-scattered: each rank gets the sum over ranks of its slice only;
  - the global gradient norm is the square root of every rank's sum of squares of its slices, all-reduced,
    and clipping scales the slices by what `clip_grad_norm_` would scale the whole gradients by;
  - AdamW (torch's own functional kernel, so the arithmetic is that of `torch.optim.AdamW`) updates this
    rank's float32 master slice and its moments; a parameter no rank produced a gradient for is skipped and
    its step count stays, as AdamW skips a parameter without `.grad`;
  - the updated slices are all-gathered in the weights' dtype straight into the model's parameters.

Why this and not megatron-core's `DistributedOptimizer`: that one needs megatron's own DDP wrapper around the
module, its `OptimizerConfig` and its bucketed grad buffers, so it would serve the megatron backend only and
replace this project's loop (packing, loss denominators, clipping, LR schedule, skipped steps, checkpoints by
name). This one sits where the replicated AdamW sits in `PolicyTrainer`, so it serves the torch and megatron
backends alike and, with 2 ranks, reproduces the replicated AdamW to float rounding (the tests check 1e-6).

Model parallelism (megatron's tensor / expert parallelism) follows the policy's `gradient_groups(name)`
(trainer/model_parallel.py): a parameter's gradient sums over, and its state is sliced over, its own
data-parallel group (an expert weight's: the expert-data-parallel group), and the squared norm of a parameter
split over ranks is summed over the group holding its other parts as well. Buckets never mix groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from miles.config import TrainerConfig
from miles.distributed import DataParallel
from miles.trainer.distributed_optimizer.grad_squares import sum_of_squares

GradientGroups = Callable[[str], tuple[DataParallel, DataParallel | None]]
"""Parameter name -> (the ranks its gradient sums over, the ranks holding its other parts or None)."""


@dataclass
class Segment:
    """A parameter's elements in its bucket: [offset, offset + numel) of the flat layout."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int


@dataclass
class Bucket:
    """Parameters of one reduction group, dtype and weight-decay class, flattened; this rank owns the
    elements [rank * shard, (rank + 1) * shard) of the (padded) flat layout."""

    group: DataParallel
    """The ranks holding the same parameters: the gradients sum over them and the state is sliced over them."""
    parts: DataParallel | None
    """The ranks holding the other parts of these (split) parameters, whose squared norms add; None: whole."""
    dtype: torch.dtype
    decays: bool
    """Matrices decay (trainer.optim.weight_decay); norms and biases (1-D) do not, as in build_optimizer."""
    segments: list[Segment]
    numel: int
    shard: int
    """Elements each rank owns: ceil(numel / world) (the last ranks' slices may be partly padding)."""
    master: torch.Tensor
    """[shard] float32: this rank's slice of the weights."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None = None
    """[shard * world] float32 summed micro-batch gradients; None between updates (freed for the engine)."""
    has_grad: set[str] = field(default_factory=set)
    """Parameters that received a gradient on this rank since the last update."""

    @property
    def begin(self) -> int:
        return self.group.rank * self.shard

    def owned(self) -> Iterator[tuple[Segment, int, int]]:
        """(segment, start, end) of each parameter overlapping this rank's slice, in slice coordinates."""
        begin, end = self.begin, self.begin + self.shard
        for seg in self.segments:
            lo, hi = max(seg.offset, begin), min(seg.offset + seg.numel, end)
            if lo < hi:
                yield seg, lo - begin, hi - begin


class ShardedAdamW:
    """AdamW whose float32 masters, moments and reduced gradients are split over each parameter's
    data-parallel group; `step` replaces the replicated path's gradient sum, clip, step and master copy."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        cfg: TrainerConfig,
        dp: DataParallel,
        gradient_groups: GradientGroups | None = None,
    ) -> None:
        optim = cfg.optim
        if len(optim.betas) != 2:
            raise ValueError(f"trainer.optim.betas needs two values, got {list(optim.betas)}")
        if not named_params:
            raise ValueError("the model has no trainable parameters")
        self.cfg = cfg
        self.betas = (float(optim.betas[0]), float(optim.betas[1]))
        self.weight_decay = float(optim.weight_decay)
        self.eps = float(optim.eps)
        groups_of = gradient_groups or (lambda _name: (dp, None))
        # Decayed matrices first, then norms and biases, as build_optimizer orders AdamW's groups.
        ordered = [(n, p) for n, p in named_params if p.ndim >= 2] + [
            (n, p) for n, p in named_params if p.ndim < 2
        ]
        keyed: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        groups: dict[tuple, tuple[DataParallel, DataParallel | None]] = {}
        for name, param in ordered:
            group, parts = groups_of(name)
            key = (id(group.group), id(parts.group) if parts else None, param.dtype, param.ndim >= 2)
            keyed.setdefault(key, []).append((name, param))
            groups[key] = (group, parts)
        self.buckets = [self._bucket(items, *groups[key], key[3]) for key, items in keyed.items()]
        self._place = {id(s.param): (b, s) for b in self.buckets for s in b.segments}
        self.steps: dict[str, int] = {name: 0 for name, _ in named_params}
        """AdamW steps each parameter has taken (its bias correction)."""
        self.names = [name for name, _ in ordered]
        self._hooks = [p.register_post_accumulate_grad_hook(self._fold) for _, p in ordered]

    def _bucket(
        self,
        items: list[tuple[str, nn.Parameter]],
        group: DataParallel,
        parts: DataParallel | None,
        decays: bool,
    ) -> Bucket:
        segments, offset = [], 0
        for name, param in items:
            segments.append(Segment(name, param, offset, param.numel()))
            offset += param.numel()
        shard = math.ceil(offset / group.world_size)
        device = items[0][1].device
        bucket = Bucket(
            group=group,
            parts=parts,
            dtype=items[0][1].dtype,
            decays=decays,
            segments=segments,
            numel=offset,
            shard=shard,
            master=torch.zeros(shard, dtype=torch.float32, device=device),
            exp_avg=torch.zeros(shard, dtype=torch.float32, device=device),
            exp_avg_sq=torch.zeros(shard, dtype=torch.float32, device=device),
        )
        self._masters_from_model(bucket)
        return bucket

    # ---- gradients -----------------------------------------------------------------------------------

    def _fold(self, param: torch.Tensor) -> None:
        # Summed in float32 into the flat buffer as each micro-batch's gradient arrives (then dropped).
        if param.grad is None:
            return
        bucket, seg = self._place[id(param)]
        self._grad_buffer(bucket)[seg.offset : seg.offset + seg.numel].add_(param.grad.reshape(-1))
        bucket.has_grad.add(seg.name)
        param.grad = None

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter's summed gradient so far (a view of its bucket's buffer, zeros where none came):
        for a policy's own reductions before `step` (tensor-parallel partial gradients)."""
        named = []
        for bucket in self.buckets:
            grad = self._grad_buffer(bucket)
            for seg in bucket.segments:
                named.append((seg.name, grad[seg.offset : seg.offset + seg.numel].view(seg.param.shape)))
        return named

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grad is None:
            world = bucket.group.world_size
            bucket.grad = torch.zeros(bucket.shard * world, dtype=torch.float32, device=bucket.master.device)
        return bucket.grad

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad = None
            bucket.has_grad = set()

    def _reduce_scatter(self, bucket: Bucket) -> tuple[torch.Tensor, set[str]]:
        """This rank's slice of the gradients summed over the group, and the parameters any rank had one for."""
        group = bucket.group
        flags = [float(s.name in bucket.has_grad) for s in bucket.segments]
        anywhere = group.all_reduce_floats(flags, "max") if group.enabled else flags
        with_grad = {s.name for s, flag in zip(bucket.segments, anywhere) if flag}
        grad = self._grad_buffer(bucket)
        if not group.enabled:
            return grad, with_grad
        import torch.distributed as dist

        out = torch.empty(bucket.shard, dtype=torch.float32, device=bucket.grad.device)
        # (torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single)
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        reduce_scatter(out, grad, group=group.group)
        bucket.grad = None  # the whole-layout buffer is not needed past this point
        return out, with_grad

    # ---- the update ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float, max_norm: float, skip: bool) -> tuple[float, bool]:
        """Reduce, clip (max_norm <= 0: no clipping), step and gather; (global grad norm, whether skipped).
        A skipped step (`skip`, or a non-finite norm) leaves weights, moments and step counts as they were."""
        reduced = [self._reduce_scatter(b) for b in self.buckets]
        squares = torch.zeros((), dtype=torch.float64, device=self.buckets[0].master.device)
        for bucket, (grad, _) in zip(self.buckets, reduced):
            local = sum_of_squares(grad).reshape(1)
            bucket.group.all_reduce(local)
            if bucket.parts is not None:  # every rank runs the buckets' collectives in one order
                bucket.parts.all_reduce(local)
            squares += local[0]
        total = squares.sqrt().float()
        grad_norm = total.item()
        self.zero_grad()
        if skip or not math.isfinite(grad_norm):
            return grad_norm, True
        if max_norm > 0:  # what clip_grad_norm_ multiplies the whole gradients by
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for grad, _ in reduced:
                grad.mul_(coef)
        for bucket, (grad, with_grad) in zip(self.buckets, reduced):
            self._adamw(bucket, grad, with_grad, lr)
        for name in {n for _, with_grad in reduced for n in with_grad}:
            self.steps[name] += 1
        for bucket in self.buckets:
            self.gather_into_model(bucket)
        return grad_norm, False

    def _adamw(self, bucket: Bucket, grad: torch.Tensor, with_grad: set[str], lr: float) -> None:
        views: dict[str, list[torch.Tensor]] = {k: [] for k in ("p", "g", "m", "v", "t")}
        for seg, lo, hi in bucket.owned():
            if seg.name not in with_grad:
                continue
            views["p"].append(bucket.master[lo:hi])
            views["g"].append(grad[lo:hi])
            views["m"].append(bucket.exp_avg[lo:hi])
            views["v"].append(bucket.exp_avg_sq[lo:hi])
            # the steps taken so far: the kernel adds this one before its bias correction, as AdamW does
            views["t"].append(
                torch.tensor(float(self.steps[seg.name]), device=grad.device, dtype=torch.float32)
            )
        if not views["p"]:
            return
        fused = grad.is_cuda or None  # as build_optimizer: the fused kernel on CUDA
        adamw(
            views["p"],
            views["g"],
            views["m"],
            views["v"],
            [],
            views["t"],
            fused=fused,
            amsgrad=False,
            beta1=self.betas[0],
            beta2=self.betas[1],
            lr=lr,
            weight_decay=self.weight_decay if bucket.decays else 0.0,
            eps=self.eps,
            maximize=False,
        )

    def gather_into_model(self, bucket: Bucket) -> None:
        """Every rank's updated slice, in the weights' dtype, into the parameters."""
        group = bucket.group
        if (
            not group.enabled
        ):  # each weight cast from its masters in place, without a copy of the whole bucket
            for seg in bucket.segments:
                seg.param.data.view(-1).copy_(bucket.master[seg.offset : seg.offset + seg.numel])
            return
        # on the weights' device: a resume may load the shards while they are offloaded to the host
        local = bucket.master.to(device=bucket.segments[0].param.device, dtype=bucket.dtype)
        if group.enabled:
            import torch.distributed as dist

            flat = torch.empty(bucket.shard * group.world_size, dtype=bucket.dtype, device=local.device)
            all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            all_gather(flat, local, group=group.group)
        else:
            flat = local
        for seg in bucket.segments:
            seg.param.data.view(-1).copy_(flat[seg.offset : seg.offset + seg.numel])

    def _masters_from_model(self, bucket: Bucket) -> None:
        for seg, lo, hi in bucket.owned():
            start = bucket.begin + lo - seg.offset
            bucket.master[lo:hi].copy_(seg.param.detach().reshape(-1)[start : start + hi - lo])

    def masters_from_model(self) -> None:
        """Take the model's weights as the masters (they were loaded from elsewhere)."""
        with torch.no_grad():
            for bucket in self.buckets:
                self._masters_from_model(bucket)

    # ---- state ---------------------------------------------------------------------------------------

    def layout(self) -> list[dict[str, Any]]:
        """The flat layout (JSON-able): a checkpoint loads only into the same one, whatever the group sizes."""
        return [
            {
                "dtype": str(b.dtype).removeprefix("torch."),
                "decays": b.decays,
                "numel": b.numel,
                "params": [[s.name, s.offset, s.numel] for s in b.segments],
            }
            for b in self.buckets
        ]

    def cut(self, world_size: int) -> dict[str, Any]:
        """How the state is sliced (JSON-able), with `world_size` processes in all: the slices' group sizes, and
        whether every bucket is sliced over all of them, whole (then any data-parallel size can read them)."""
        sizes = [b.group.world_size for b in self.buckets]
        whole = all(size == world_size and b.parts is None for size, b in zip(sizes, self.buckets))
        return {"world_sizes": sizes, "world": world_size, "reshardable": whole}

    def shard_tensors(self) -> Iterator[tuple[str, Bucket, torch.Tensor]]:
        """(key, bucket, this rank's slice) of every state tensor: masters and both moments."""
        for i, bucket in enumerate(self.buckets):
            yield f"bucket{i}.master", bucket, bucket.master
            yield f"bucket{i}.exp_avg", bucket, bucket.exp_avg
            yield f"bucket{i}.exp_avg_sq", bucket, bucket.exp_avg_sq

    def state_bytes(self) -> int:
        """Device bytes of this rank's optimizer state (masters and moments)."""
        return sum(t.numel() * t.element_size() for _, _, t in self.shard_tensors())

    def grad_bytes(self) -> int:
        """Device bytes the flat gradient buffers take during an update."""
        return sum(4 * b.shard * b.group.world_size for b in self.buckets)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
