"""What keeps a run from going on pointlessly or ending with nothing kept: a stop after steps that could not
learn, and Ctrl-C / SIGTERM taken at the end of the current step (so its checkpoint can be written)."""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from miles.distributed import DataParallel
from miles.errors import MilesUserError

log = logging.getLogger("miles.rl")


def failed_step_reason(record: dict[str, float], num_samples: int) -> str | None:
    """Why a step's record shows it could not learn, or None."""
    if num_samples and record.get("reward/errors", 0.0) >= num_samples:
        return "every sample's reward raised an error (reward/errors)"
    steps = record.get("train/optimizer_steps")
    if steps is None:
        return "no sample had a response, so no update was taken"
    if steps and record.get("train/skipped_steps", 0.0) >= steps:
        return "every optimizer step was skipped for a non-finite gradient (train/skipped_steps)"
    loss = record.get("train/loss")
    if loss is not None and not math.isfinite(loss):
        return "the loss is not finite (train/loss)"
    return None


class FailedStepGuard:
    """Counts consecutive steps that could not learn; warns at each and stops the run at `limit` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.streak = limit, 0

    def check(self, step: int, record: dict[str, float], num_samples: int) -> None:
        reason = failed_step_reason(record, num_samples)
        if reason is None:
            self.streak = 0
            return
        self.streak += 1
        log.warning("step %d could not learn: %s (%d such step(s) in a row)", step, reason, self.streak)
        if self.limit and self.streak >= self.limit:
            raise MilesUserError(
                f"{self.streak} steps in a row could not learn, the last ({step}) because {reason}; fix the "
                "cause (see run.log and samples.jsonl), or raise trainer.stop_after_failed_steps (0: never stop)"
            )


REPEAT_WINDOW_S = 0.5
"""A signal this soon after the first is the same request: `timeout -s INT` signals the process and then its
process group, and when Python's handler runs between the two, a second call would stop the run at once,
without its checkpoint."""


class StopRequest:
    """Ctrl-C or SIGTERM asks the run to stop after the step in flight; a second one stops it at once."""

    def __init__(self) -> None:
        self.asked_at: float | None = None

    @property
    def asked(self) -> bool:
        return self.asked_at is not None

    def _ask(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.asked_at is not None:
            if now - self.asked_at < REPEAT_WINDOW_S:
                return
            raise KeyboardInterrupt
        self.asked_at = now
        log.warning("%s: stopping after this step (again to stop now)", signal.Signals(signum).name)

    @contextmanager
    def installed(self, dp: DataParallel) -> Iterator[StopRequest]:
        """The handlers, in a one-process run's main thread (signals reach no other), restored after. The
        ranks of a multi-process run keep the default: their launcher stops them all together."""
        previous = {}
        if not dp.enabled:
            try:
                previous = {sig: signal.signal(sig, self._ask) for sig in (signal.SIGINT, signal.SIGTERM)}
            except ValueError:  # not the main thread
                previous = {}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
