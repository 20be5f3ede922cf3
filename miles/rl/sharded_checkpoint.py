"""The distributed optimizer's checkpoint: each rank writes its own shards (float32 master slices and AdamW
moments) through `torch.distributed.checkpoint`, into `checkpoints/step_N/optimizer_shards/`.

Every rank writes its slices under keys of their own (`bucket<i>.<kind>.rank<r>`), so nothing is gathered
to rank 0. The shards are written into a staging folder next to the checkpoints first; rank 0 moves it into
the checkpoint folder before that folder is renamed into place, so a checkpoint appears whole or not at all.
The flat layout does not depend on the number of ranks, only the slicing does: a resume with another
data-parallel size reads, on each rank, the saved slices that overlap its new one.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.trainer.sharded_optimizer import Bucket, ShardedAdamW

SHARDS_DIR = "optimizer_shards"
_STAGING = ".optimizer_shards_step_{step:06d}.tmp"


def _key(index: int, kind: str, rank: int) -> str:
    return f"bucket{index}.{kind}.rank{rank}"


def _valid(numel: int, shard: int, rank: int) -> int:
    """Real (unpadded) elements of a rank's slice."""
    return max(0, min(shard, numel - rank * shard))


def _own_state(sharded: ShardedAdamW) -> dict[str, torch.Tensor]:
    state = {}
    for index, bucket in enumerate(sharded.buckets):
        valid = _valid(bucket.numel, bucket.shard, bucket.group.rank)
        if valid:
            for kind, tensor in _kinds(bucket):
                state[_key(index, kind, bucket.group.rank)] = tensor[:valid]
    return state


def _kinds(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    return [("master", bucket.master), ("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)]


def save_optimizer_shards(sharded: ShardedAdamW, checkpoints: Path, step: int, dp: DataParallel) -> Path:
    """Write every rank's shards into a staging folder under `checkpoints` (a collective of `dp`); returns
    it, for rank 0 to move into the checkpoint with `move_into`."""
    import torch.distributed.checkpoint as dcp

    if any(b.group.world_size != dp.world_size for b in sharded.buckets):
        raise MilesUserError(
            "saving a distributed optimizer whose parameters reduce over groups other than the data-parallel "
            "one (expert parallelism) is not supported yet; use trainer.distributed_optimizer=false"
        )
    staging = checkpoints / _STAGING.format(step=step)
    if dp.is_main:  # what an earlier save cut short left behind
        checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in checkpoints.glob(".optimizer_shards_step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dp.barrier()
    state = {k: v.detach().cpu() for k, v in _own_state(sharded).items()}
    dcp.save(state, checkpoint_id=str(staging), process_group=dp.group, no_dist=not dp.enabled)
    dp.barrier()  # every rank's files are written before rank 0 moves the folder
    return staging


def move_into(staging: Path, folder: Path) -> None:
    staging.rename(folder / SHARDS_DIR)


def load_optimizer_shards(
    sharded: ShardedAdamW, folder: Path, world_sizes: list[int], dp: DataParallel
) -> None:
    """This rank's slices from the shards of `folder` (written by `world_sizes[i]` ranks for bucket i)."""
    import torch.distributed.checkpoint as dcp

    path = folder / SHARDS_DIR
    if not path.is_dir():
        raise MilesUserError(
            f"{folder} has no {SHARDS_DIR}/ (the distributed optimizer's state): it was not saved by a run "
            "with trainer.distributed_optimizer=true"
        )
    if len(world_sizes) != len(sharded.buckets):
        raise MilesUserError(f"{path} holds {len(world_sizes)} buckets, this run has {len(sharded.buckets)}")
    wanted: dict[str, torch.Tensor] = {}
    plans = []  # (bucket, kind tensor, saved key, [lo, hi) in the flat layout)
    for index, (bucket, saved_world) in enumerate(zip(sharded.buckets, world_sizes)):
        saved_shard = math.ceil(bucket.numel / saved_world)
        begin, end = bucket.begin, min(bucket.begin + bucket.shard, bucket.numel)
        for rank in range(saved_world):
            lo, hi = max(begin, rank * saved_shard), min(end, (rank + 1) * saved_shard)
            if lo >= hi:
                continue
            for kind, tensor in _kinds(bucket):
                key = _key(index, kind, rank)
                wanted[key] = torch.empty(_valid(bucket.numel, saved_shard, rank), dtype=torch.float32)
                plans.append((tensor, key, lo - rank * saved_shard, lo - begin, hi - lo))
    dcp.load(wanted, checkpoint_id=str(path), process_group=dp.group, no_dist=not dp.enabled)
    with torch.no_grad():
        for tensor, key, src, dst, count in plans:
            tensor[dst : dst + count].copy_(wanted[key][src : src + count])
        for bucket in sharded.buckets:
            sharded.gather_into_model(bucket)  # the weights as the masters round to
