"""`PolicyTrainer`'s side of the distributed optimizer: building it for a policy, its update step and its
checkpoint meta (the shards themselves go through miles/rl/sharded_checkpoint.py)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from miles.config import TrainerConfig
from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.trainer.distributed_optimizer.adamw import ShardedAdamW

logger = logging.getLogger(__name__)

META_KEY = "distributed_optimizer"
"""The trainer-state meta entry of a distributed optimizer's checkpoint: its flat layout and step counts."""


def build_sharded_optimizer(
    model: nn.Module, cfg: TrainerConfig, dp: DataParallel, world: DataParallel
) -> ShardedAdamW | None:
    """The distributed optimizer over `model`'s trainable parameters when `trainer.distributed_optimizer`.

    `dp` is the replicas' group (dense gradients sum over it), `world` every rank. A policy split over ranks
    (megatron TP / EP) names each parameter's groups through `model.gradient_groups(name) -> (sum group,
    parts group or None)` (trainer/model_parallel.py); a whole model is sliced over `dp`."""
    if not cfg.distributed_optimizer:
        return None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    split = getattr(model, "gradient_groups", None)
    if split is None:
        return ShardedAdamW(named, cfg, dp)
    handles: dict[int, DataParallel] = {}

    def handle(group: Any) -> DataParallel:
        # the trainer's own handle for its replicas' group, so dense buckets use `dp` itself
        if group is getattr(model, "data_parallel_group", None) or group is dp.group:
            return dp
        return handles.setdefault(id(group), world.within(group))

    def groups_of(name: str) -> tuple[DataParallel, DataParallel | None]:
        group, parts = split(name)
        return handle(group), None if parts is None else handle(parts)

    return ShardedAdamW(named, cfg, dp, groups_of)


def sharded_update(trainer: Any, skip: bool) -> dict[str, float]:
    """One optimizer step of `trainer` (a PolicyTrainer) through its distributed optimizer."""
    lr = trainer.lr
    if trainer.tp.enabled:  # q/k norms' and routers' partial gradients, summed over TP first
        trainer.model.reduce_tensor_parallel_gradients(trainer.sharded.named_grads())
    grad_norm, skipped = trainer.sharded.step(lr, trainer.cfg.optim.grad_clip, skip)
    if skipped:
        logger.warning("skipping an optimizer step (grad norm %s, or no loss tokens)", grad_norm)
    trainer.optimizer_steps_done += 1  # the schedule advances either way, as in the replicated path
    return {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_steps": float(skipped)}


def sharded_state_dict(trainer: Any) -> dict[str, Any]:
    """The schedule, the flat layout and each parameter's step count; no tensors (each rank's shards are
    written by miles/rl/sharded_checkpoint.py)."""
    sharded: ShardedAdamW = trainer.sharded
    meta = {
        "optimizer_steps_done": trainer.optimizer_steps_done,
        "total_optimizer_steps": trainer.total_optimizer_steps,
        # the step counts travel with the shards (they may differ between expert-parallel ranks)
        META_KEY: {"layout": sharded.layout(), **sharded.cut(trainer.world.world_size)},
    }
    return {"tensors": {}, "meta": meta}


def check_optimizer_kind(trainer: Any, meta: dict[str, Any]) -> None:
    """A checkpoint resumes only into the optimizer kind that wrote it."""
    saved_sharded = META_KEY in meta
    if saved_sharded and trainer.sharded is None:
        raise MilesUserError(
            "this checkpoint holds a distributed optimizer's shards: resume it with "
            "trainer.distributed_optimizer=true"
        )
    if not saved_sharded and trainer.sharded is not None:
        raise MilesUserError(
            "this checkpoint holds a replicated AdamW state: resume it with trainer.distributed_optimizer=false"
        )


def load_sharded_state_dict(trainer: Any, meta: dict[str, Any]) -> None:
    """The schedule of `meta`; the masters restart from the (just loaded) model weights until the shards
    are read (miles/rl/sharded_checkpoint.py)."""
    sharded: ShardedAdamW = trainer.sharded
    saved = meta[META_KEY]
    if saved["layout"] != sharded.layout():
        raise MilesUserError(
            "the checkpoint's distributed-optimizer layout differs from this run's (another model, trainable "
            "set, dtype or weight decay); resume with the settings it was saved with"
        )
    sharded.masters_from_model()
    trainer.optimizer_steps_done = int(meta["optimizer_steps_done"])
    total = meta.get("total_optimizer_steps")
    trainer.total_optimizer_steps = None if total is None else int(total)
