"""An RL run's checkpoints: what a checkpoint holds beside the model (trainer, loader, engine and draft
state, RNG), and resuming a run from one so that it repeats the uninterrupted run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from miles.config import MilesConfig
from miles.data import PromptLoader
from miles.distributed import SINGLE, DataParallel
from miles.resume import (
    DRAFT_DIR,
    DRAFT_HEAD_DIR,
    RunState,
    config_changes,
    restore_rng,
    write_run_state,
)
from miles.rl.sharded_checkpoint import load_optimizer_shards, move_into, save_optimizer_shards
from miles.tracking import Tracker, read_records, redact
from miles.trainer.distributed_optimizer.trainer import META_KEY as SHARDED_META_KEY

log = logging.getLogger("miles.rl")


def state_writer(
    cfg: MilesConfig,
    step: int,
    trainer: Any,
    draft_trainer: Any,
    loader_state: dict[str, Any],
    engine: Any,
    wandb_run_id: str | None,
    dp: DataParallel,
    run_dir: Path | None = None,
) -> Callable[[Path], None]:
    """What writes a checkpoint's resume state into its folder. Called on every rank: the engine states
    and a tensor-parallel optimizer state are gathered here (collectives); rank 0 writes. A distributed
    optimizer's shards are written here by every rank, under `run_dir` (miles/rl/sharded_checkpoint.py)."""
    engine_state = engine.state_dict()
    if dp.enabled:  # every rank's, written by rank 0
        engine_state = {"ranks": dp.all_gather_objects(engine_state)}
    # With model parallelism the optimizer state is gathered from the ranks holding its parts (collectives:
    # the TP group, and for split experts ranks across the replicas): here, by every rank; rank 0 writes it.
    trainer_state = trainer.state_dict() if getattr(trainer, "model_parallel", False) else None
    staging = None
    if getattr(trainer, "sharded", None) is not None:
        assert run_dir is not None, "a distributed optimizer's shards are staged under the run folder"
        staging = save_optimizer_shards(trainer.sharded, run_dir / "checkpoints", step, trainer.world)
    zero_staging = None
    if getattr(trainer, "zero", None) is not None:  # DeepSpeed's shards, every rank's, staged the same way
        assert run_dir is not None, "DeepSpeed's shards are staged under the run folder"
        zero_staging = trainer.zero.stage(run_dir / "checkpoints", step)

    def write(folder: Path) -> None:
        if staging is not None:
            move_into(staging, folder)
        if zero_staging is not None:
            from miles.trainer.deepspeed.policy import CHECKPOINT_DIR

            zero_staging.rename(folder / CHECKPOINT_DIR)
        draft_state = None
        if draft_trainer is not None:
            draft_trainer.save_weights(folder)
            draft_state = draft_trainer.state_dict()
        write_run_state(
            folder,
            step,
            redact(asdict(cfg)),
            trainer_state if trainer_state is not None else trainer.state_dict(),
            loader_state,
            engine_state,
            wandb_run_id,
            draft_state,
        )

    return write


_SCHEDULE_KEYS = (
    "trainer.global_batch_size",
    "trainer.epochs_per_rollout",
    "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt",
)
"""Settings that change how many optimizer steps an RL step takes, so the LR schedule's length."""


def schedule_resize(cfg: MilesConfig, folder: Path, state: RunState) -> int | None:
    """Warns of the settings a resume changes; the steps the LR schedule must be re-sized to from where it
    stands when one changes its length (None: it stands as saved)."""
    changes = config_changes(state.config, redact(asdict(cfg)))
    if changes:
        log.warning(
            "resuming %s with %d setting(s) changed, so it will not repeat the first run: %s",
            folder,
            len(changes),
            "; ".join(changes[:10]),
        )
    max_steps = cfg.trainer.max_steps
    resized = [c for c in changes if c.startswith(_SCHEDULE_KEYS)]
    if max_steps != state.max_steps:
        resized.append(f"trainer.max_steps: {state.max_steps} -> {max_steps}")
    if not resized:
        return None
    # The cosine schedule ends at the run's last step from where it stands, with the steps a call now takes.
    log.info("the LR schedule is re-sized from the current position (%s)", "; ".join(resized))
    return max_steps - state.step


def resume_run(
    cfg: MilesConfig,
    folder: Path,
    state: RunState,
    model: Any,
    engine: Any,
    trainer: Any,
    loader: PromptLoader,
    tracker: Tracker | None,
    dp: DataParallel = SINGLE,
) -> int:
    """Load a checkpoint's weights, optimizer, schedule, loader position and RNG states into the run, and
    the interrupted run's metrics up to it into this run's; returns the step it finished."""
    from miles.models.checkpoint import iter_hf_tensors, load_state_into

    resize_to = schedule_resize(cfg, folder, state)
    with torch.no_grad():
        load_state_into(model, iter_hf_tensors(folder), str(folder))
    if trainer.model is not model:  # the megatron backend trains a copy of the weights
        trainer.model.load_from(model)
    trainer.load_state_dict(state.trainer)
    if getattr(trainer, "sharded", None) is not None:  # this rank's slices of the saved shards
        cut = state.trainer["meta"][SHARDED_META_KEY]
        load_optimizer_shards(trainer.sharded, folder, cut, trainer.world)
    if getattr(trainer, "zero", None) is not None:  # the weights, float32 masters and moments DeepSpeed saved
        from miles.trainer.deepspeed.policy import CHECKPOINT_DIR

        trainer.zero.load(folder / CHECKPOINT_DIR)
    if resize_to is not None:
        trainer.resize_schedule(resize_to)
    loader.load_state_dict(state.loader)
    engine_state = state.engine.get("ranks", [state.engine])  # one entry per rank of the saved run
    if len(engine_state) != dp.world_size:
        log.warning(
            "the checkpoint holds the engine state of %d process(es) and this run has %d: unseeded requests "
            "will not draw as they would have",
            len(engine_state),
            dp.world_size,
        )
    if dp.rank < len(engine_state) and engine_state[dp.rank]:
        engine.load_state_dict(engine_state[dp.rank])
    if tracker is not None:
        tracker.carry_over(folder.parent.parent, state.step)  # checkpoints/step_N/ -> the run folder
    restore_rng(state)
    log.info("resumed from %s (step %d)", folder, state.step)
    return state.step


def resume_draft(folder: Path, state: RunState, draft_trainer: Any) -> None:
    """Load the trained draft (model or head) and its optimizer state of a checkpoint; a checkpoint of a run
    that did not train this kind of draft leaves the draft as the run's settings loaded it."""
    if state.draft is None or not (folder / draft_trainer.weights_dir).is_dir():
        log.warning(
            "%s holds no trained draft of this kind (no %s/): the draft starts again from the run's settings",
            folder,
            draft_trainer.weights_dir,
        )
        return
    draft_trainer.load_weights(folder)
    draft_trainer.load_state_dict(state.draft)


def continued_wandb_run(checkpoint: Path, state: RunState) -> str | None:
    """The interrupted run's W&B run id, when this run can go on with it: W&B drops steps at or below a
    run's last one, so only if the interrupted run logged nothing past the checkpoint's step (it crashed
    before its next step finished). Otherwise the resumed run gets a W&B run of its own."""
    if not state.wandb_run_id:
        return None
    records = read_records(checkpoint.parent.parent)
    last = records[-1].get("step") if records else None
    if last != state.step:
        log.info(
            "the interrupted run logged up to step %s, past the checkpoint's %d: this run gets a new W&B run",
            last,
            state.step,
        )
        return None
    return state.wandb_run_id


def warn_unused_draft(folder: Path) -> None:
    """A checkpoint's trained draft that this run's settings do not draft with."""
    if (folder / DRAFT_DIR).is_dir():
        log.warning(
            "%s holds a trained draft model, which this run does not use (rollout.spec_draft_train is "
            "off); to draft with it, set rollout.spec_draft_model=%s",
            folder,
            folder / DRAFT_DIR,
        )
    elif (folder / DRAFT_HEAD_DIR).is_dir():
        log.warning(
            "%s holds a trained draft head, which this run does not use (rollout.spec_draft_train is "
            "off); to draft with it, set rollout.speculative=head rollout.spec_head=%s",
            folder,
            folder / DRAFT_HEAD_DIR,
        )
