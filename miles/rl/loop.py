"""The RL loop. Build once; then each step: collect (rollout + rewards, with filtering) → train → sync the
new weights into the engine (verified) → eval / save → log.

With several processes (`placement.num_processes`, or torchrun; miles/distributed/) each rank generates and
scores its share of the batch's groups, the advantages and batch metrics are computed over every rank's
samples, the trainer sums gradients across ranks, and rank 0 writes the run folder.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from miles.config import MilesConfig
from miles.distributed import SINGLE, DataParallel, reduce_metrics
from miles.errors import MilesUserError
from miles.rl.collect import Collected
from miles.rl.guards import FailedStepGuard, StopRequest
from miles.rl.parts import RLParts, build_parts
from miles.rl.time_report import TimeReport
from miles.rl.update import train_on
from miles.weight_sync.verified import VerifiedSync, sync_verified

log = logging.getLogger("miles.rl")
PROGRESS_KEYS = ("reward/mean", "eval/accuracy", "train/loss", "time/step")


def run_rl(
    cfg: MilesConfig,
    run_dir: Path,
    dp: DataParallel = SINGLE,
    build: Callable[[MilesConfig, Path, DataParallel], RLParts] = build_parts,
) -> dict[str, float]:
    """`build`: the placement's parts (`placement=ray`: miles.placement.ray.parts.build_ray_parts); the
    loop is the same whatever runs where."""
    run = build(cfg, run_dir, dp)
    last: dict[str, float] = {}
    times = TimeReport()
    failed_steps, stop = FailedStepGuard(cfg.trainer.stop_after_failed_steps), StopRequest()
    with stop.installed(dp):
        try:
            first_step = start(run)
            for step in range(first_step, cfg.trainer.max_steps + 1):
                began = time.perf_counter()
                if run.busy is not None:
                    run.busy.start()
                collected = run.collector.collect(step)
                # trainer.async_rollout=one_step: the next step's rollout runs during this step's update.
                run.collector.collect_ahead(step + 1, cfg.trainer.max_steps)
                metrics = {**collected.metrics, **train(run, collected, step)}
                run.collector.wait_ahead()
                synced = sync_weights(run, step)
                metrics.update(synced.checks)
                metrics.update(evaluate_if_due(run, step))
                own = {**collected.own_metrics, **synced.own_metrics()}
                if run.busy is not None and (fraction := run.busy.stop()) is not None:
                    own[run.busy.metric] = fraction
                own["time/step"] = time.perf_counter() - began
                # The step's records before its checkpoint: a resume from it never skips a step's records.
                last = log_step(run, step, collected, own, metrics)
                times.add(last)
                save_if_due(run, step, force=stop.asked)
                if stop.asked:
                    raise KeyboardInterrupt(
                        f"stopped after step {step}: resume with trainer.resume_from={run_dir}"
                    )
                failed_steps.check(step, last, len(collected.everyone))
        finally:
            run.close()
            if run.tracker is not None and times.steps:
                log.info("%s", times.render())
    return last


def start(run: RLParts) -> int:
    """The first step to run: after the checkpoint's on a resume (the engine then serves its weights),
    else 1, with the start evaluated where the run evaluates."""
    cfg = run.cfg
    if run.resume_from is None:
        if cfg.trainer.eval_every and run.inputs.test_prompts:
            # What loading the data dropped goes into the run's first record (records are appended, not
            # merged): step 0's when the start is evaluated, else step 1's.
            eval_metrics = run.rollout.evaluate(run.inputs.test_prompts)
            if run.tracker is not None:
                run.tracker.log_step(0, {**eval_metrics, **run.unreported})
            run.unreported = {}
        return 1
    first_step = run.load_checkpoint() + 1
    if first_step > cfg.trainer.max_steps:
        raise MilesUserError(
            f"the checkpoint already finished step {first_step - 1} of trainer.max_steps="
            f"{cfg.trainer.max_steps}; raise trainer.max_steps to train further"
        )
    result = run.sync.sync(version=first_step - 1)  # the engine serves the checkpoint's weights from here on
    if not result.checksum_ok:
        raise RuntimeError(f"weight sync checksum mismatch after resuming: {result.mismatched[:5]}")
    return first_step


def train(run: RLParts, collected: Collected, step: int) -> dict[str, float]:
    """Advantages over the batch and the trainer side's update on this rank's samples."""
    filtering = run.collector.group_filter is not None
    return train_on(run.cfg, collected, run.trainer_side, run.rollout, run.dp, step, filtering)


def sync_weights(run: RLParts, step: int) -> VerifiedSync:
    """The new weights into the engine, verified; a draft trained this step invalidates its cached KV."""
    if run.trainer_side.draft_trainer is not None:
        run.engine.draft_weights_changed()
    return sync_verified(run.sync, step, run.dp, run.run_dir / "checkpoints")


def evaluate_if_due(run: RLParts, step: int) -> dict[str, float]:
    every, is_last = run.cfg.trainer.eval_every, step == run.cfg.trainer.max_steps
    if every and run.inputs.test_prompts and (step % every == 0 or is_last):
        return run.rollout.evaluate(run.inputs.test_prompts)
    return {}


def save_if_due(run: RLParts, step: int, force: bool = False) -> None:
    """The step's checkpoint when `save_every` / `save_final` ask for it, or when the run stops (`force`)."""
    trainer_cfg, is_last = run.cfg.trainer, step == run.cfg.trainer.max_steps
    every = trainer_cfg.save_every
    if not (force or (every and step % every == 0) or (is_last and trainer_cfg.save_final)):
        return
    tracker = run.tracker
    wandb_run_id = tracker.wandb_run_id if tracker is not None and tracker.wandb_run_id else run.wandb_run_id
    run.save_checkpoint(step, wandb_run_id)


def log_step(
    run: RLParts, step: int, collected: Collected, own: dict[str, float], metrics: dict[str, float]
) -> dict[str, float]:
    """The step's record: this rank's measurements combined over the ranks, then the batch-wide values,
    which win where both have a key (`rollout/aborted` counts what a failed generate plugin cost too)."""
    record = {**reduce_metrics(run.dp, own, len(collected.own)), **metrics, **run.unreported}
    run.unreported = {}
    if run.tracker is not None:  # in one process's order (the ranks' samples come rank after rank)
        run.tracker.log_samples(step, sorted(collected.everyone, key=lambda s: (s.group_id, s.index)))
        run.tracker.log_step(step, record)
        if not sys.stdout.isatty():  # no progress bar to watch: a line a step (in run.log too)
            shown = {k: record[k] for k in PROGRESS_KEYS if k in record}
            log.info(
                "step %d/%d %s",
                step,
                run.cfg.trainer.max_steps,
                " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
            )
    return record
