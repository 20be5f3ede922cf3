"""A pool of reward worker processes with a hard per-call timeout.

Each slot owns one worker process (forked from the multiprocessing fork server, so it starts with math-verify
already imported) and one dispatcher thread that feeds it one call at a time. A call past its timeout gets its
worker killed and replaced; only that call's samples are lost. A worker leads a process group of its own, and the
whole group is killed (on a timeout, a replacement and at close), so processes a reward started die with it. A
worker that dies (segfault, os._exit, the OOM killer) or hits its memory cap is replaced too. Each reward is built
in a worker (a class reward's constructor may load a model) under BIND_TIMEOUT_S, before any sample's
reward.timeout_s clock starts; the pool's rewards are built as soon as its workers start, during the first
rollout. The pool lives as long as its RewardRunner, so the start-up cost is paid once per run, not per batch.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from miles.rewards.loading import RewardFunction
from miles.rewards.outcome import RewardOutcome, failure
from miles.rewards.reaping import descendants, kill_all
from miles.sample import Sample

log = logging.getLogger("miles.rewards")

WORKER_MODULE = "miles.rewards.worker"
POLL_INTERVAL_S = 0.1
"""How often a waiting dispatcher checks for shutdown."""
ASYNC_GRACE_S = 5.0
"""An async reward's samples run concurrently in the worker, each under reward.timeout_s there; the pool waits
this much longer for the chunk before it kills the worker (sync work blocking the worker's event loop)."""
BIND_TIMEOUT_S = 300.0
"""How long a worker may take to build a reward (import it, run a class reward's constructor: load a model) before
it is killed; separate from reward.timeout_s, which times each sample once the reward exists."""


@dataclass
class _Job:
    fn: RewardFunction
    samples: list[Sample]
    timeout_s: float
    future: Future[list[RewardOutcome]] = field(default_factory=Future)


def _cancelled(count: int) -> list[RewardOutcome]:
    return [failure("cancelled", "the reward runner was closed before this call finished")] * count


class WorkerPool:
    def __init__(
        self,
        num_workers: int,
        memory_mb: int,
        start_method: str = "forkserver",
        prebind: Sequence[RewardFunction] = (),
        bind_timeout_s: float | None = None,
    ) -> None:
        """prebind: rewards each worker builds as soon as it starts (a failure there is reported by the first
        call that needs the reward). bind_timeout_s: deadline for building one reward, BIND_TIMEOUT_S by default."""
        if num_workers < 1:
            raise ValueError(f"a worker pool needs num_workers >= 1, got {num_workers}")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([WORKER_MODULE])
        self.memory_mb = memory_mb
        self.prebind = list(prebind)
        self.bind_timeout_s = float(BIND_TIMEOUT_S if bind_timeout_s is None else bind_timeout_s)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self.restarts = 0
        """Workers killed and replaced (timeouts, crashes, memory caps)."""
        self._slots = [_Slot(self, i) for i in range(num_workers)]

    def submit(
        self, fn: RewardFunction, samples: list[Sample], timeout_s: float
    ) -> Future[list[RewardOutcome]]:
        job = _Job(fn, samples, timeout_s)
        if self._closing.is_set():
            job.future.set_result(_cancelled(len(samples)))
        else:
            self._jobs.put(job)
        return job.future

    def count_restart(self) -> None:
        with self._lock:
            self.restarts += 1

    def next_call_id(self) -> int:
        return next(self._call_ids)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancels queued and running calls (their futures resolve as `cancelled`) and stops every worker."""
        if self._closing.is_set():
            return
        self._closing.set()
        for _ in self._slots:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            slot.thread.join(max(0.0, deadline - time.monotonic()))
            slot.kill()
        while True:  # jobs queued behind the stop markers
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.future.done():
                job.future.set_result(_cancelled(len(job.samples)))


class _Slot:
    def __init__(self, pool: WorkerPool, index: int) -> None:
        self.pool = pool
        self.process: mp.process.BaseProcess | None = None
        self.conn = None
        self.bound: set[str] = set()
        """Rewards built in the current worker process."""
        self.thread = threading.Thread(target=self._loop, name=f"miles-reward-slot-{index}", daemon=True)
        self.thread.start()

    def _spawn(self) -> None:
        from miles.rewards.worker import worker_main

        parent_conn, child_conn = self.pool._ctx.Pipe(duplex=True)
        process = self.pool._ctx.Process(
            target=worker_main,
            args=(child_conn, self.pool.memory_mb),
            name="miles-reward-worker",
            daemon=False,
        )
        process.start()
        child_conn.close()
        self.process, self.conn, self.bound = process, parent_conn, set()

    def kill(self) -> None:
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if process is not None:
            _kill_group(process)
            process.join(timeout=5)
        if conn is not None:
            conn.close()

    def _loop(self) -> None:
        try:
            if not self.pool._closing.is_set():
                try:
                    self._spawn()  # start now so the worker's imports overlap with the first rollout
                    for fn in self.pool.prebind:  # and so do the rewards' constructors
                        self._bind(fn)
                except (
                    Exception
                ):  # retried per call; each call that cannot get a worker fails instead of hanging
                    log.exception("could not start a reward worker")
            while True:
                job = self.pool._jobs.get()
                if job is None:
                    break
                if self.pool._closing.is_set():
                    job.future.set_result(_cancelled(len(job.samples)))
                    continue
                try:
                    outcomes = self._execute(job)
                except (
                    BaseException
                ) as e:  # a failure of the pool itself (cannot start a worker): fail the call
                    log.exception("reward worker pool error")
                    outcomes = [failure("crash", f"the reward worker pool failed: {e!r}")] * len(job.samples)
                job.future.set_result(outcomes)
        finally:
            self.kill()

    def _ensure_worker(self) -> None:
        if self.process is None or not self.process.is_alive():
            self.kill()
            self._spawn()

    def _bind(self, fn: RewardFunction) -> RewardOutcome | None:
        """Builds `fn` in the worker under the pool's bind_timeout_s; the failure every sample of the call gets,
        or None once it is built."""
        self._ensure_worker()
        if fn.name in self.bound:
            return None
        try:
            self.conn.send(("bind", fn))
        except (BrokenPipeError, ConnectionResetError, EOFError):  # it died right after the liveness check
            return self._died_building(fn)
        state = self._wait_for_reply(time.monotonic() + self.pool.bind_timeout_s)
        if state == "closing":
            self.kill()
            return _cancelled(1)[0]
        if state == "timeout":
            self.kill()
            self.pool.count_restart()
            return failure(
                "timeout",
                f"building reward {fn.name!r} took longer than {self.pool.bind_timeout_s:g} s (the worker "
                "pool's bind timeout, BIND_TIMEOUT_S); its worker was replaced",
            )
        try:
            kind, name, problem = self.conn.recv()
        except (EOFError, OSError):
            return self._died_building(fn)
        if kind != "bound" or name != fn.name:
            self.kill()
            return failure("crash", "reward worker protocol error")
        if problem is None:
            self.bound.add(fn.name)
        elif problem.error_kind == "memory":  # its heap may be full: start the next call on a fresh one
            self.kill()
            self.pool.count_restart()
        return problem

    def _died_building(self, fn: RewardFunction) -> RewardOutcome:
        exit_code = self._reap()
        self.pool.count_restart()
        return failure("crash", f"the reward worker died building {fn.name!r} (exit code {exit_code})")

    def _send(self, fn: RewardFunction, message: tuple) -> RewardOutcome | None:
        """Sends a call to a worker that has built `fn`; the failure of building it, or None once sent."""
        for attempt in range(2):
            problem = self._bind(fn)
            if problem is not None:
                return problem
            try:
                self.conn.send(message)
                return None
            except (BrokenPipeError, ConnectionResetError, EOFError):  # the idle worker died: replace it once
                self.kill()
                self.pool.count_restart()
                if attempt:
                    raise
        return None

    def _wait_for_reply(self, deadline: float) -> str:
        """'ready' | 'closing' | 'timeout'."""
        while not self.conn.poll(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic()))):
            if self.pool._closing.is_set():
                return "closing"
            if time.monotonic() >= deadline:
                return "timeout"
        return "ready"

    def _execute(self, job: _Job) -> list[RewardOutcome]:
        """Runs a job's samples in order on this slot's worker. Each sample (or the whole call, for a batched
        reward) gets its own timeout; a sample that hangs or kills the worker costs only itself: the worker is
        replaced and the rest of the job continues on the new one."""
        count = len(job.samples)
        step = count if job.fn.batched or job.fn.is_async else 1  # one reply for the chunk (worker.py)
        limit_s = job.timeout_s + (ASYNC_GRACE_S if job.fn.is_async else 0.0)
        results: list[RewardOutcome | None] = [None] * count
        done = 0
        while done < count:
            call_id, base = self.pool.next_call_id(), done
            try:
                problem = self._send(job.fn, (call_id, job.fn, job.samples[base:], job.timeout_s))
            except (
                pickle.PicklingError,
                TypeError,
                AttributeError,
                ValueError,
            ) as e:  # cannot pickle the call
                note = failure("exception", f"could not send the call to a reward worker: {e}")
                return [note] * count
            if problem is not None:  # the reward could not be built: every sample left gets why
                results[done:] = [problem] * (count - done)
                break
            deadline = time.monotonic() + limit_s
            while done < count:
                state = self._wait_for_reply(deadline)
                if state == "closing":
                    self.kill()
                    return [r if r is not None else _cancelled(1)[0] for r in results]
                if state == "timeout":
                    self.kill()  # a hung reward is killed with its worker, never waited on
                    self.pool.count_restart()
                    message = (
                        f"took longer than {job.timeout_s:g} s (reward.timeout_s); its worker was replaced"
                    )
                    results[done : done + step] = [failure("timeout", message)] * step
                    done += step
                    break
                try:
                    reply_id, offset, outcomes, recycle = self.conn.recv()
                except (EOFError, OSError):
                    exit_code = self._reap()
                    self.pool.count_restart()
                    message = (
                        f"the reward worker died (exit code {exit_code}: a crash, os._exit or the OOM killer)"
                    )
                    results[done : done + step] = [failure("crash", message)] * step
                    done += step
                    break
                if (
                    reply_id != call_id or base + offset != done
                ):  # never attribute an outcome to the wrong sample
                    self.kill()
                    return [
                        r if r is not None else failure("crash", "reward worker protocol error")
                        for r in results
                    ]
                results[done : done + len(outcomes)] = outcomes
                done += len(outcomes)
                deadline = time.monotonic() + limit_s
                if recycle:
                    self.kill()
                    self.pool.count_restart()
                    break
        return [r for r in results if r is not None]

    def _reap(self) -> int | None:
        """Kills what the dead worker left in its group (before the worker is joined, so its pid is not yet
        free for reuse) and returns its exit code."""
        process = self.process
        self.kill()
        return process.exitcode if process is not None else None


def _kill_group(process: mp.process.BaseProcess) -> None:
    """SIGKILLs a worker, every process in its group (it called setsid: the group id is its pid) and every
    process below it in the tree, found first: one a reward started in a session of its own (a daemon, which
    the worker, a subreaper, keeps below itself) is no member of the group."""
    below = descendants(process.pid) if process.pid is not None and process.is_alive() else []
    if process.pid is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not (yet) a group leader, or the group is gone
            pass
    if process.is_alive():
        process.kill()
    kill_all(below)
