"""Train on a collected step: rewards shaped and turned into advantages over the whole batch, then the
trainer side's update on this rank's samples, with the engine's KV memory lent to it where configured."""

from __future__ import annotations

import logging
import time

from miles.config import MilesConfig
from miles.distributed import DataParallel
from miles.rl.collect import Collected
from miles.rl.rollout_side import RolloutSide
from miles.rl.trainer_side import TrainerSide
from miles.trainer.algorithms import compute_advantages
from miles.trainer.group_filter import trainable
from miles.trainer.overlong import apply_overlong_penalty

log = logging.getLogger("miles.rl")


def train_on(
    cfg: MilesConfig,
    collected: Collected,
    trainer_side: TrainerSide,
    rollout: RolloutSide,
    dp: DataParallel,
    step: int,
    filtering: bool,
) -> dict[str, float]:
    """The step's batch-wide train metrics; this rank's timings go into `collected.own_metrics`."""
    metrics: dict[str, float] = {}
    algo = cfg.algorithm
    if algo.overlong_buffer:  # after the filter, which judges the rewards as scored
        shaping = (cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        metrics.update(apply_overlong_penalty(collected.train_everyone, *shaping))
    # An aborted request (engine error, failed generate plugin) has no response: it costs its sample, never
    # the step, and stays out of its group's advantages (its reward 0 would lift the others').
    usable = [s for s in collected.train_everyone if trainable(s)]
    metrics.update(compute_advantages(usable, algo))
    if dp.enabled:  # the batch-wide samples are copies: their advantages go to this rank's own
        advantages = {(s.group_id, s.index): s.advantage for s in usable}
        for sample in collected.train_own:
            sample.advantage = advantages.get((sample.group_id, sample.index), 0.0)
    samples = [s for s in collected.train_own if trainable(s)]
    metrics["train/dropped_samples"] = float(len(collected.train_everyone) - len(usable))
    if usable:  # updates between the weights a sample was drawn with and the policy it trains (async: 1)
        staleness = [step - 1 - s.weight_version for s in usable]
        metrics["train/staleness_mean"] = sum(staleness) / len(staleness)
        metrics["train/staleness_max"] = float(max(staleness))
    if not usable and filtering and not collected.kept:
        log.warning(
            "step %d: algorithm.group_filter kept no group in %d batches; skipping the update",
            step,
            collected.batches,
        )
    elif not usable:
        log.warning("step %d: no sample has a response; skipping the update", step)
    timings = collected.own_metrics
    began = time.perf_counter()
    with rollout.released_for_update(bool(usable), timings):
        metrics.update(trainer_side.train(collected.own, samples, bool(usable), timings))
    # The policy's update and the KV release around it (the draft's update is time/draft_train).
    timings["time/train"] = time.perf_counter() - began - timings.get("time/draft_train", 0.0)
    return metrics
