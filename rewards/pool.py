"""A pool of reward worker processes with a hard per-call timeout.

Each slot owns one worker process (forked from the multiprocessing fork server, so it starts with math-verify
already imported) and one dispatcher thread that feeds it one call at a time. A call past its timeout gets its
worker killed and replaced; only that call's samples are lost. A worker that dies (segfault, os._exit, the OOM
killer) or hits its memory cap is replaced too. The pool lives as long as its RewardRunner, so the start-up cost
is paid once per run, not per batch.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import pickle
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from miles.rewards.loading import RewardFunction
from miles.rewards.outcome import RewardOutcome, failure
from miles.sample import Sample

log = logging.getLogger("miles.rewards")

WORKER_MODULE = "miles.rewards.worker"
POLL_INTERVAL_S = 0.1
"""How often a waiting dispatcher checks for shutdown."""


@dataclass
class _Job:
    fn: RewardFunction
    samples: list[Sample]
    timeout_s: float
    future: Future[list[RewardOutcome]] = field(default_factory=Future)


def _cancelled(count: int) -> list[RewardOutcome]:
    return [failure("cancelled", "the reward runner was closed before this call finished")] * count


class WorkerPool:
    def __init__(self, num_workers: int, memory_mb: int, start_method: str = "forkserver") -> None:
        if num_workers < 1:
            raise ValueError(f"a worker pool needs num_workers >= 1, got {num_workers}")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([WORKER_MODULE])
        self.memory_mb = memory_mb
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
        self.process, self.conn = process, parent_conn

    def kill(self) -> None:
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        if conn is not None:
            conn.close()

    def _loop(self) -> None:
        try:
            if not self.pool._closing.is_set():
                try:
                    self._spawn()  # start now so the worker's imports overlap with the first rollout
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

    def _send(self, message: tuple) -> None:
        if self.process is None or not self.process.is_alive():
            self.kill()
            self._spawn()
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):  # the idle worker died: replace it once
            self.kill()
            self.pool.count_restart()
            self._spawn()
            self.conn.send(message)

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
        step = count if job.fn.batched else 1
        results: list[RewardOutcome | None] = [None] * count
        done = 0
        while done < count:
            call_id, base = self.pool.next_call_id(), done
            try:
                self._send((call_id, job.fn, job.samples[base:]))
            except (
                pickle.PicklingError,
                TypeError,
                AttributeError,
                ValueError,
            ) as e:  # cannot pickle the call
                note = failure("exception", f"could not send the call to a reward worker: {e}")
                return [note] * count
            deadline = time.monotonic() + job.timeout_s
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
                deadline = time.monotonic() + job.timeout_s
                if recycle:
                    self.kill()
                    self.pool.count_restart()
                    break
        return [r for r in results if r is not None]

    def _reap(self) -> int | None:
        process = self.process
        if process is not None:
            process.join(timeout=5)
        exit_code = process.exitcode if process is not None else None
        self.kill()
        return exit_code
