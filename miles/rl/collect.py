"""Collect one RL step's samples: a batch of prompts generated and scored, and with a group filter (DAPO's
dynamic sampling) further batches until enough groups are kept."""

from __future__ import annotations

import logging
import statistics
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from miles.config import MilesConfig
from miles.data import PromptLoader
from miles.distributed import DataParallel, gather_samples
from miles.rl.rollout_side import RolloutSide
from miles.sample import Sample, SampleStatus
from miles.trainer.group_filter import GroupFilter, combine_round_metrics, filter_metrics, kept_groups

log = logging.getLogger("miles.rl")


@dataclass
class Collected:
    """A step's samples: this rank's own (with their logprobs, for the update) and every rank's
    (batch-wide, for advantages and logs), each also cut to the groups the step trains on."""

    own: list[Sample] = field(default_factory=list)
    everyone: list[Sample] = field(default_factory=list)
    train_own: list[Sample] = field(default_factory=list)
    train_everyone: list[Sample] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch-wide metrics (the same on every rank)."""
    own_metrics: dict[str, float] = field(default_factory=dict)
    """This rank's measurements, combined over the ranks at the end of the step."""
    batches: int = 0
    kept: list[int] = field(default_factory=list)
    """Group ids the filter kept (every group without a filter is not listed)."""


class Collector:
    def __init__(
        self,
        cfg: MilesConfig,
        rollout: RolloutSide,
        loader: PromptLoader,
        group_filter: GroupFilter | None,
        dp: DataParallel,
    ) -> None:
        self.rollout, self.loader, self.group_filter, self.dp = rollout, loader, group_filter, dp
        self.batch_size, self.max_new_tokens = cfg.rollout.rollout_batch_size, cfg.rollout.max_new_tokens
        self.seed, self.max_batches = cfg.rollout.seed, cfg.algorithm.filter_max_batches
        self.warned_short = False
        self.one_step_ahead = cfg.trainer.async_rollout == "one_step"
        self._ahead: tuple[int, Future[Collected]] | None = None
        self._loader_before_ahead: dict | None = None
        self._pool: ThreadPoolExecutor | None = None

    def collect(self, step: int) -> Collected:
        """Step `step`'s samples: those collected ahead for it, or drawn now."""
        if self._ahead is not None:
            ahead_step, future = self._ahead
            self._ahead, self._loader_before_ahead = None, None
            assert ahead_step == step, (ahead_step, step)
            return future.result()
        return self._collect(step)

    def collect_ahead(self, step: int, last_step: int) -> None:
        """With `trainer.async_rollout=one_step`, start collecting `step` (on the engines' current weights)
        while the caller trains the step before it; a no-op past `last_step` or when not asynchronous."""
        if not self.one_step_ahead or step > last_step:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="miles-collect-ahead")
        self._loader_before_ahead = self.loader.state_dict()
        self._ahead = (step, self._pool.submit(self._collect, step))

    def wait_ahead(self) -> None:
        """Until the collect started ahead has finished (the engines are idle: the sync may land)."""
        if self._ahead is not None:
            self._ahead[1].exception()  # raised where it is taken, by `collect`

    def loader_state(self) -> dict:
        """The loader's position for a checkpoint: before the prompts a collect ahead drew (a resume draws
        them again, for the step that follows the checkpoint's)."""
        return (
            self._loader_before_ahead if self._loader_before_ahead is not None else self.loader.state_dict()
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _collect(self, step: int) -> Collected:
        out = Collected(own_metrics={"time/rollout": 0.0, "time/reward": 0.0})
        reward_rounds: list[tuple[dict[str, float], float]] = []
        step_seed = self.seed * 1_000_003 + step
        while True:  # one batch of prompts; more only while a group filter has kept too few groups
            # The first batch draws as a run without a filter does; the next ones draw other numbers (a
            # prompt may come round again). Group ids stay unique in the step.
            seed = step_seed if out.batches == 0 else step_seed * 1_000_033 + out.batches
            first_group = out.batches * self.batch_size
            batch = [replace(p, group_id=first_group + i) for i, p in enumerate(self.loader.next_batch())]
            drawn, reward_metrics = self.rollout.generate_scored(batch, seed, out.own_metrics)
            reward_rounds.append((reward_metrics, float(len(drawn))))
            drawn_everyone, _ = gather_samples(self.dp, drawn)  # batch-wide: every rank's samples
            out.own += drawn
            out.everyone += drawn_everyone
            out.batches += 1
            if self.group_filter is None:
                break
            out.kept += kept_groups(drawn_everyone, self.group_filter)
            if len(out.kept) >= self.batch_size or out.batches >= self.max_batches:
                break
        out.own_metrics.update(self.rollout.metrics())
        out.own_metrics.update(combine_round_metrics(reward_rounds))
        out.metrics = rollout_metrics(out.everyone)
        out.train_own, out.train_everyone = out.own, out.everyone
        if self.group_filter is not None:
            self._keep_filtered(out, step)
        return out

    def _keep_filtered(self, out: Collected, step: int) -> None:
        out.metrics.update(filter_metrics(out.everyone, out.kept, out.batches, self.batch_size))
        if len(out.kept) < self.batch_size and not self.warned_short:
            log.warning(
                "step %d: algorithm.group_filter kept %d of the %d groups a step trains on in %d batches "
                "(algorithm.filter_max_batches); the step trains on those (see rollout/filter_kept_groups; "
                "warned once)",
                step,
                len(out.kept),
                self.batch_size,
                out.batches,
            )
            self.warned_short = True
        chosen = set(out.kept[: self.batch_size])
        out.train_everyone = [s for s in out.everyone if s.group_id in chosen]
        out.train_own = [s for s in out.own if s.group_id in chosen]


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    rewards = [s.reward for s in samples]
    return {
        "response_length/mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples)
        / max(len(samples), 1),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/aborted": float(sum(s.status == SampleStatus.ABORTED for s in samples)),
    }
