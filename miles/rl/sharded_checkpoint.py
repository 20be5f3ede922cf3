"""The distributed optimizer's checkpoint: each rank writes its own shards (float32 master slices, AdamW
moments and step counts) through `torch.distributed.checkpoint`, into `checkpoints/step_N/optimizer_shards/`.

Nothing is gathered to rank 0: every rank writes its slices under keys of their own. The shards are written
into a staging folder next to the checkpoints first; rank 0 moves it into the checkpoint folder before that
folder is renamed into place, so a checkpoint appears whole or not at all.

When every bucket is sliced over all the ranks (data parallelism alone) the keys name the slice
(`bucket<i>.<kind>.rank<r>`) and the flat layout does not depend on the number of ranks: a resume with another
data-parallel size reads, on each rank, the saved slices that overlap its new one. A model split by tensor or
expert parallelism keys its slices by process (`.world<r>`) and resumes on the same process count and
parallel sizes only (refused otherwise, with what to do).

Loading never unpickles arbitrary objects: DCP's `.metadata` is read by `miles.rl.vetted_reader` (an
allow-list of DCP's own metadata classes), the tensors by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.trainer.distributed_optimizer.adamw import Bucket, ShardedAdamW

SHARDS_DIR = "optimizer_shards"
_STAGING = ".optimizer_shards_step_{step:06d}.tmp"


def _reshardable(sharded: ShardedAdamW, world: DataParallel) -> bool:
    return bool(sharded.cut(world.world_size)["reshardable"])


def _tag(bucket: Bucket, world: DataParallel, reshardable: bool) -> str:
    return f"rank{bucket.group.rank}" if reshardable else f"world{world.rank}"


def _valid(numel: int, shard: int, rank: int) -> int:
    """Real (unpadded) elements of a rank's slice."""
    return max(0, min(shard, numel - rank * shard))


def _kinds(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    return [("master", bucket.master), ("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)]


def _steps(sharded: ShardedAdamW, bucket: Bucket) -> torch.Tensor:
    return torch.tensor([float(sharded.steps[s.name]) for s in bucket.segments], dtype=torch.float64)


def save_optimizer_shards(sharded: ShardedAdamW, checkpoints: Path, step: int, world: DataParallel) -> Path:
    """Write every rank's shards into a staging folder under `checkpoints` (a collective of all the ranks);
    returns it, for rank 0 to move into the checkpoint with `move_into`."""
    import torch.distributed.checkpoint as dcp

    reshardable = _reshardable(sharded, world)
    state: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(sharded.buckets):
        tag = _tag(bucket, world, reshardable)
        valid = _valid(bucket.numel, bucket.shard, bucket.group.rank)
        for kind, tensor in _kinds(bucket):
            if valid:
                state[f"bucket{index}.{kind}.{tag}"] = tensor[:valid].detach().cpu()
        state[f"bucket{index}.steps.{tag}"] = _steps(sharded, bucket)
    staging = checkpoints / _STAGING.format(step=step)
    if world.is_main:  # what an earlier save cut short left behind
        checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in checkpoints.glob(".optimizer_shards_step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    world.barrier()
    dcp.save(state, checkpoint_id=str(staging), process_group=world.group, no_dist=not world.enabled)
    world.barrier()  # every rank's files are written before rank 0 moves the folder
    return staging


def move_into(staging: Path, folder: Path) -> None:
    staging.rename(folder / SHARDS_DIR)


def load_optimizer_shards(
    sharded: ShardedAdamW, folder: Path, meta: dict[str, Any], world: DataParallel
) -> None:
    """This rank's slices and step counts from the shards of `folder`, cut as `meta` (`shards_meta`) says; then
    the weights as the masters round to (a collective of all the ranks)."""
    import torch.distributed.checkpoint as dcp

    path = folder / SHARDS_DIR
    if not path.is_dir():
        raise MilesUserError(
            f"{folder} has no {SHARDS_DIR}/ (the distributed optimizer's state): it was not saved by a run "
            "with trainer.distributed_optimizer=true"
        )
    sizes, now = meta["world_sizes"], [b.group.world_size for b in sharded.buckets]
    reshardable = bool(meta["reshardable"]) and _reshardable(sharded, world)
    if not reshardable and (meta["world"] != world.world_size or sizes != now):
        raise MilesUserError(
            f"{path} was written by {meta['world']} processes with the model split by tensor / expert "
            f"parallelism (slices over {sizes} ranks); resume it with the same process count and parallel "
            f"sizes (this run: {world.world_size} processes, slices over {now})"
        )
    wanted: dict[str, torch.Tensor] = {}
    copies = []  # (this rank's tensor, saved key, from, to, count)
    for index, (bucket, saved_world) in enumerate(zip(sharded.buckets, sizes)):
        saved_shard = math.ceil(bucket.numel / saved_world)
        begin, end = bucket.begin, min(bucket.begin + bucket.shard, bucket.numel)
        for rank in range(saved_world) if reshardable else [bucket.group.rank]:
            lo, hi = max(begin, rank * saved_shard), min(end, (rank + 1) * saved_shard)
            tag = f"rank{rank}" if reshardable else f"world{world.rank}"
            for kind, tensor in _kinds(bucket) if lo < hi else []:
                key = f"bucket{index}.{kind}.{tag}"
                wanted[key] = torch.empty(_valid(bucket.numel, saved_shard, rank), dtype=torch.float32)
                copies.append((tensor, key, lo - rank * saved_shard, lo - begin, hi - lo))
        steps_key = f"bucket{index}.steps.{'rank0' if reshardable else f'world{world.rank}'}"
        wanted[steps_key] = torch.empty(len(bucket.segments), dtype=torch.float64)
    from miles.rl.vetted_reader import VettedMetadataReader

    reader = VettedMetadataReader(path)  # .metadata through the restricted unpickler, never plain pickle
    dcp.load(wanted, storage_reader=reader, process_group=world.group, no_dist=not world.enabled)
    with torch.no_grad():
        for tensor, key, src, dst, count in copies:
            tensor[dst : dst + count].copy_(wanted[key][src : src + count])
        for index, bucket in enumerate(sharded.buckets):
            steps = wanted[f"bucket{index}.steps.{'rank0' if reshardable else f'world{world.rank}'}"]
            for seg, count in zip(bucket.segments, steps.tolist()):
                sharded.steps[seg.name] = int(count)
            sharded.gather_into_model(bucket)
