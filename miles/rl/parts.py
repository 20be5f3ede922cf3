"""Everything an RL run is built from, once, before its first step: data, the rollout side (engine,
rewards), the trainer side (policy and draft trainers), the weight sync between them, and the tracker."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles.build import RunInputs, build_engine, build_inputs, build_reference, build_rewards, build_trainer
from miles.config import MilesConfig
from miles.data import PromptLoader
from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.placement.remote_engine import RemoteEngine, start_engine_process
from miles.resume import RunState, find_checkpoint, read_run_state, save_checkpoint
from miles.rl.checkpointing import (
    continued_wandb_run,
    resume_draft,
    resume_run,
    state_writer,
    warn_unused_draft,
)
from miles.rl.collect import Collector
from miles.rl.rollout_side import RolloutSide
from miles.rl.trainer_side import TrainerSide
from miles.tracking import Tracker, check_new_run_dir, redact
from miles.trainer.group_filter import load_group_filter
from miles.utilization import BusyMeter, busy_meter


@dataclass
class ResumePoint:
    folder: Path
    """The checkpoint (`checkpoints/step_N/`)."""
    state: RunState


@dataclass
class RLParts:
    cfg: MilesConfig
    run_dir: Path
    dp: DataParallel
    inputs: RunInputs
    loader: PromptLoader
    rollout: RolloutSide
    collector: Collector
    trainer_side: TrainerSide
    sync: Any  # InProcessWeightSync or, to an engine process, TransportWeightSync: with checksums
    tracker: Tracker | None
    busy: BusyMeter | None
    resume_from: ResumePoint | None = None
    wandb_run_id: str | None = None
    unreported: dict[str, float] = field(default_factory=dict)
    """Batch-wide metrics that wait for the next logged record (what loading the data dropped)."""

    @property
    def trainer(self) -> Any:
        return self.trainer_side.trainer

    @property
    def engine(self) -> Any:
        return self.rollout.engine

    def load_checkpoint(self) -> int:
        """The resume point's weights, optimizer, loader, engine and RNG state into the run; its step."""
        assert self.resume_from is not None
        folder, state = self.resume_from.folder, self.resume_from.state
        args = (self.inputs.model, self.engine, self.trainer, self.loader, self.tracker, self.dp)
        step = resume_run(self.cfg, folder, state, *args)
        if self.trainer_side.draft_trainer is not None:
            resume_draft(folder, state, self.trainer_side.draft_trainer)
            self.engine.draft_weights_changed()
        else:
            warn_unused_draft(folder)
        return step

    def save_checkpoint(self, step: int, wandb_run_id: str | None) -> None:
        """`checkpoints/step_N/` (rank 0 writes; every rank takes part in gathering the engines' state)."""
        draft_trainer = self.trainer_side.draft_trainer
        write_extra = state_writer(
            self.cfg,
            step,
            self.trainer,
            draft_trainer,
            self.collector.loader_state(),
            self.engine,
            wandb_run_id,
            self.dp,
            self.run_dir,
        )
        if self.dp.is_main:
            model, tokenizer = self.inputs.model, self.inputs.tokenizer
            save_checkpoint(model, tokenizer, self.run_dir, step, write_extra, self.cfg.trainer.keep_last)

    def close(self) -> None:
        if self.busy is not None:
            self.busy.stop()
        self.collector.close()
        self.rollout.close()
        if isinstance(self.engine, RemoteEngine):  # its transport first: the engine process answers it
            self.sync.close()
            self.engine.close()
        if self.tracker is not None:
            self.tracker.close()


def build_parts(cfg: MilesConfig, run_dir: Path, dp: DataParallel) -> RLParts:
    from miles.weight_sync import InProcessWeightSync

    inputs = build_inputs(cfg, dp)
    model = inputs.model
    trainer = build_trainer(cfg, model, dp, ref_model=build_reference(cfg, dp))
    trainer_side, drafts = TrainerSide.build(cfg, model, trainer, dp)
    # The KV pool takes its fraction of the memory the trainer's first update will not need (colocated).
    reserve = trainer_side.memory_reserve_bytes()
    if cfg.placement.engine_process:
        engine, sync = start_engine_process(cfg, trainer.model, model.device, reserve)
        rewards = build_rewards(cfg)
    else:
        engine = build_engine(cfg, model, inputs.tokenizer, reserve, **drafts)
        trainer_side.outside_peak = engine.outside_allocator_peak  # its regions count in the memory peaks
        # After it, `model` holds the trainer's weights; the fingerprints are compared across replicas only.
        sync = InProcessWeightSync(trainer.model, engine, replica_fingerprints=dp.enabled)
        rewards = build_rewards(cfg, engine)  # a judge reward may drive the policy's engine
    rollout = RolloutSide(cfg, engine, rewards, inputs.stop_token_ids, dp)
    collector = build_collector(cfg, inputs, rollout, dp)
    resume_from, wandb_run_id, tracker = build_tracking(cfg, run_dir, inputs, dp)
    busy = busy_meter(model.device)  # util/gpu_busy_frac on CUDA, util/cpu_busy_frac on CPU
    return RLParts(
        cfg, run_dir, dp, inputs, collector.loader, rollout, collector, trainer_side, sync, tracker, busy,
        resume_from, wandb_run_id, inputs.dropped_metrics() if resume_from is None else {},
    )  # fmt: skip


def build_collector(cfg: MilesConfig, inputs: RunInputs, rollout: RolloutSide, dp: DataParallel) -> Collector:
    """The step's collector over the training prompts, in the loader's order (the same on every rank)."""
    loader = PromptLoader(
        inputs.train_prompts, cfg.rollout.rollout_batch_size, cfg.data.shuffle, cfg.data.seed
    )
    return Collector(cfg, rollout, loader, load_group_filter(cfg.algorithm.group_filter), dp)


def build_tracking(
    cfg: MilesConfig, run_dir: Path, inputs: RunInputs, dp: DataParallel
) -> tuple[ResumePoint | None, str | None, Tracker | None]:
    """Where the run resumes from, the W&B run it continues, and its tracker (rank 0's)."""
    resume_from = find_resume_point(cfg, run_dir, dp)
    wandb_run_id = continued_wandb_run(resume_from.folder, resume_from.state) if resume_from else None
    if not dp.is_main:
        return resume_from, wandb_run_id, None
    tracker = Tracker(
        run_dir,
        cfg.logging,
        redact(asdict(cfg)),
        cfg.recipe,
        cfg.trainer.max_steps,
        inputs.tokenizer,
        wandb_run_id=wandb_run_id,
    )
    return resume_from, wandb_run_id, tracker


def find_resume_point(cfg: MilesConfig, run_dir: Path, dp: DataParallel) -> ResumePoint | None:
    """The checkpoint `trainer.resume_from` names: rank 0's choice for every rank (with `auto`, another
    run may save a newer checkpoint meanwhile)."""
    if not cfg.trainer.resume_from:
        return None
    found: str | MilesUserError
    try:
        found = str(find_checkpoint(cfg.trainer.resume_from, run_dir, cfg.recipe)) if dp.is_main else ""
        if found:  # checkpoints/step_N/ -> its run folder
            check_new_run_dir(run_dir, Path(found).parent.parent)
    except MilesUserError as e:
        found = e
    found = dp.broadcast_object(found)
    if isinstance(found, MilesUserError):
        raise found
    folder = Path(found)
    return ResumePoint(folder, read_run_state(folder))
