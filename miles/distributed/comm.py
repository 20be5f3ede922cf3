"""The handle on the data-parallel process group: N processes, each one device with its own engine and a
replica of the trainer, the gradients summed across them.

Every rank takes the same global prompt batch and generates the groups `batch[rank::world]`, so a group's
`n` samples stay on one engine (they share its radix cache) and a request draws what it would draw in one
process (its seed is its prompt's, not its rank's). The trainer sums gradients across ranks before each
optimizer step, so the replicas apply the same update and stay bit-identical; the loop checks that they do.

`DataParallel` is the one handle on the process group: code takes it as an argument (`SINGLE` when there
is one process) instead of asking torch.distributed globally.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from miles.distributed.launcher import STORE_ENV, world_from_env
from miles.errors import MilesUserError

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    on_cuda: bool = False
    """The ranks run on GPUs (one each, `cuda:local_rank`) and talk through NCCL; else gloo on CPU."""
    group: Any = None
    """The process group the collectives run in (None: the whole world); `rank` and `world_size` are within it."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share: every world_size-th item from position rank (whole items, in order)."""
        return list(items[self.rank :: self.world_size])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across ranks (`sum`, `max`, `min`); a no-op with one process."""
        if self.enabled:
            import torch.distributed as dist

            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=self.group)
        return tensor

    def all_reduce_floats(self, values: Sequence[float], op: str = "sum") -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        return self.all_reduce(tensor, op).tolist()

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._global_rank(0), group=self.group)
        return box[0]

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's copy of `module`."""
        if not self.enabled:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=self._global_rank(0), group=self.group)

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.on_cuda else torch.device("cpu")

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)

    def within(self, group: Any) -> DataParallel:
        """The same process in a subgroup of the world (its rank and size there)."""
        import torch.distributed as dist

        return replace(self, rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group)


SINGLE = DataParallel()


def init_data_parallel(requested: int, device: str, timeout_s: float = 1800.0) -> DataParallel:
    """Join the process group torchrun (or `launch`) described in the environment; SINGLE for one process.

    `requested` is `placement.num_processes`: 1 accepts whatever world the launcher made.
    """
    world = world_from_env()
    if requested > 1 and world not in (1, requested):
        raise MilesUserError(
            f"placement.num_processes={requested} but the launcher started {world} processes; "
            "make them agree (or leave placement.num_processes=1 under torchrun)"
        )
    if world == 1:
        return SINGLE
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise MilesUserError(
                f"process {rank} needs GPU {local_rank} but {visible} are visible: start at most one process "
                "per GPU (placement.num_processes), or use model.device=cpu"
            )
        torch.cuda.set_device(local_rank)  # model.device=cuda / auto then resolves to this rank's GPU
    if not dist.is_initialized():
        store_file = os.environ.get(STORE_ENV)  # set by `launch`; torchrun's env:// otherwise
        dist.init_process_group(
            backend="nccl" if on_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            **(
                {"init_method": f"file://{store_file}", "rank": rank, "world_size": world}
                if store_file
                else {}
            ),
        )
    return DataParallel(rank=rank, world_size=world, local_rank=local_rank, on_cuda=on_cuda)


def shutdown(dp: DataParallel) -> None:
    if dp.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank done with the group before one tears it down (gloo aborts on an early close)
            dist.destroy_process_group()
