"""Running rewards inside the trainer process: async rewards (I/O-bound: remote servers), rewards that need objects
living there (the judge's engine), and every reward when reward.num_workers=0.

Sync calls run one at a time on a helper thread. A call past its timeout is abandoned (Python cannot kill a
thread) and a fresh helper takes over; the abandoned thread finishes, or not, in the background. A reward that
drives an engine (the judge: an `engine` with `generate`) is never abandoned: the abandoned thread would go on
stepping that engine beside the next call, or beside the rollout when it is the policy's own, and engines are
stepped by one thread at a time. Its calls end by themselves (generation stops at max_new_tokens), so they are
waited for. Async calls run
concurrently on an event-loop thread, each under its own timeout; a reward that blocks that loop (sync work inside
an `async def`) gets the loop abandoned and replaced the same way. Only worker processes give a hard kill and a
memory cap, which is why they are the default for sync rewards.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from miles.rewards.calls import call_async, call_sync
from miles.rewards.loading import BoundReward, RewardFunction, bind
from miles.rewards.outcome import RewardOutcome, failure
from miles.sample import Sample

log = logging.getLogger("miles.rewards")

ASYNC_GRACE_S = 5.0
"""Extra time an async batch may take past reward.timeout_s before its event loop is considered blocked."""
CLOSE_TIMEOUT_S = 5.0


def _timeouts(count: int, timeout_s: float, what: str) -> list[RewardOutcome]:
    return [failure("timeout", f"took longer than {timeout_s:g} s (reward.timeout_s); {what}")] * count


class _Helper:
    """One thread running sync calls in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._loop, name="miles-reward-helper", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or self.abandoned:
                return
            fn, bound, samples, future = job
            future.set_result(call_sync(fn, bound, samples))


class _EventLoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="miles-reward-loop", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()


def drives_an_engine(bound: BoundReward) -> bool:
    """Whether a reward holds an engine it generates with (the judge), which only one thread may step."""
    return callable(getattr(getattr(bound.instance, "engine", None), "generate", None))


class InProcessExecutor:
    def __init__(self) -> None:
        self._bound: dict[str, BoundReward] = {}
        self._helper: _Helper | None = None
        self._loop: _EventLoopThread | None = None
        self.abandoned = 0
        """Helper threads / event loops given up on after a timeout (they may still be running)."""

    def bind(self, fn: RewardFunction) -> None:
        """Builds the reward now (raises what its constructor raises: a configuration problem)."""
        self._bound[fn.name] = bind(fn)

    def run_sync(self, fn: RewardFunction, samples: list[Sample], timeout_s: float) -> list[RewardOutcome]:
        if self._helper is None:
            self._helper = _Helper()
        future: Future[list[RewardOutcome]] = Future()
        bound = self._bound[fn.name]
        self._helper.jobs.put((fn, bound, samples, future))
        try:
            return future.result(timeout=None if drives_an_engine(bound) else timeout_s)
        except FutureTimeout:
            self._helper.abandoned = True
            self._helper.jobs.put(None)
            self._helper = None
            self.abandoned += 1
            return _timeouts(
                len(samples), timeout_s, "its thread was abandoned (use reward.num_workers > 0 to kill)"
            )

    def run_async(
        self, calls: list[tuple[RewardFunction, list[Sample]]], timeout_s: float
    ) -> list[list[RewardOutcome]]:
        """Runs all calls concurrently; one list of outcomes per call, in order."""
        if not calls:
            return []
        if self._loop is None:
            self._loop = _EventLoopThread()

        async def gather() -> list[list[RewardOutcome]]:
            return list(
                await asyncio.gather(
                    *(call_async(fn, self._bound[fn.name], samples, timeout_s) for fn, samples in calls)
                )
            )

        future = asyncio.run_coroutine_threadsafe(gather(), self._loop.loop)
        try:
            return future.result(timeout=timeout_s + ASYNC_GRACE_S)
        except FutureTimeout:
            future.cancel()
            self._loop = (
                None  # blocked by sync code inside an async reward: leave it, start a fresh loop next time
            )
            self.abandoned += 1
            log.error(
                "an async reward blocked its event loop for more than %.0f s (sync work inside `async def`?); "
                "that loop was abandoned",
                timeout_s + ASYNC_GRACE_S,
            )
            return [_timeouts(len(samples), timeout_s, "it blocked the event loop") for _, samples in calls]

    def close(self) -> None:
        for name, bound in self._bound.items():
            instance = bound.instance
            try:
                if hasattr(instance, "aclose") and self._loop is not None:
                    asyncio.run_coroutine_threadsafe(instance.aclose(), self._loop.loop).result(
                        CLOSE_TIMEOUT_S
                    )
                elif hasattr(instance, "close"):
                    instance.close()
            except Exception as e:  # closing is best effort; a failing close must not stop the shutdown
                log.warning("closing reward %r failed: %r", name, e)
        self._bound.clear()
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if self._helper is not None:
            self._helper.jobs.put(None)
            # Joined, not left to die at exit: a daemon thread that ran torch (the judge's engine) and is
            # frozen mid-exit aborted the process ("terminate called without an active exception", rc -6)
            # after its work was done.
            self._helper.thread.join(CLOSE_TIMEOUT_S)
            self._helper = None
