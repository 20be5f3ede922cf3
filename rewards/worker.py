"""The reward worker process's main loop.

This module is preloaded in the multiprocessing fork server, so the heavy grader dependencies (math-verify / sympy)
are imported once there and every worker forked from it starts warm.
"""

from __future__ import annotations

import asyncio
import os
import signal
from multiprocessing.connection import Connection

import math_verify  # noqa: F401  (preloaded: see the module docstring)

from miles.rewards.calls import call_async, call_sync
from miles.rewards.loading import BoundReward, RewardFunction, bind
from miles.rewards.outcome import RewardOutcome, failure, outcome_from_exception
from miles.rewards.reaping import become_subreaper, descendants, kill_all, reap_children


def _limit_address_space(memory_mb: int) -> None:
    """Caps this worker's address space at its start-up size plus `memory_mb`: a reward allocating past it gets a
    MemoryError (scored as kind `memory`) instead of taking the machine down."""
    if memory_mb <= 0:
        return
    import resource

    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kb * 1024 + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _reply(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except Exception as e:  # e.g. an unpicklable extra field slipped through
        call_id, offset, outcomes, recycle = message
        note = failure("bad_return", f"the result could not be sent back: {e}")
        conn.send((call_id, offset, [note] * len(outcomes), recycle))


def _bind_once(bound: dict[str, BoundReward], fn: RewardFunction) -> RewardOutcome | None:
    """Builds `fn` in this worker unless it already is; the failure (a class constructor raised) or None."""
    if fn.name in bound:
        return None
    try:
        bound[fn.name] = bind(fn)
    except BaseException as e:  # building the reward (a class constructor) is user code too
        return outcome_from_exception(e)
    return None


class _Leftovers:
    """Ends the processes a reward call left running (a fork that sleeps, a daemon): they would pile up, one a
    call, for the whole run. Processes a reward's constructor started (a checker kept warm) are the reward's
    and live as long as the worker."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.kept: set[int] = set()
        self.subreaper = become_subreaper()  # a daemon's double fork then stays below this worker

    def keep_current(self) -> None:
        self.kept = set(descendants(self.pid))

    def end(self) -> None:
        left = descendants(self.pid, prune=self.kept)  # a kept helper's own children are its business
        if left:
            kill_all(left)
            reap_children(self.pid, self.kept)


def _run_async(
    loop: asyncio.AbstractEventLoop, fn: RewardFunction, bound: BoundReward, samples: list, timeout_s: float
) -> list[RewardOutcome]:
    """An async reward's samples, all at once on this worker's event loop (kept across calls: a client the
    reward holds belongs to one loop), each under `timeout_s`."""

    async def gather() -> list[RewardOutcome]:
        if fn.batched:  # one call takes the whole list
            return await call_async(fn, bound, samples, timeout_s)
        calls = [call_async(fn, bound, [sample], timeout_s) for sample in samples]
        return [outcome for outcomes in await asyncio.gather(*calls) for outcome in outcomes]

    return loop.run_until_complete(gather())


def worker_main(conn: Connection, memory_mb: int) -> None:
    """Receives ("bind", RewardFunction) or (call_id, RewardFunction, samples, timeout_s).

    A bind builds the reward (a class reward's constructor may load a model) and replies ("bound", name, failure
    or None); the pool times it with its own, generous deadline (pool.BIND_TIMEOUT_S), so the per-sample clock
    of reward.timeout_s starts only once the reward exists. A call replies (call_id, offset, outcomes, recycle)
    after each sample (once for a batched reward, and once for an async one, whose samples run concurrently),
    so the parent can time each sample while the worker moves straight on to the next. None or EOF stops it.
    Rewards run on this process's main thread, so signal-based timeouts work. The worker leads a process group
    of its own, so the pool can kill whatever a reward started (a checker, a compiler) together with it, and
    after each sample it ends the processes the reward left running (`_Leftovers`)."""
    try:
        os.setsid()
    except OSError:  # already a group leader (never under multiprocessing): the pool kills just this pid then
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pool
    _limit_address_space(memory_mb)
    leftovers = _Leftovers()
    bound: dict[str, BoundReward] = {}
    loop: asyncio.AbstractEventLoop | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "bind":
            fn = message[1]
            problem = _bind_once(bound, fn)
            _exit_if_forked_copy(leftovers.pid)
            leftovers.keep_current()
            conn.send(("bound", fn.name, problem))
            continue
        call_id, fn, samples, timeout_s = message
        together = fn.batched or fn.is_async
        groups = [samples] if together else [[s] for s in samples]
        offset = 0
        for group in groups:
            known = len(bound)
            problem = _bind_once(bound, fn)  # normally bound already, by a bind message
            if len(bound) != known:
                leftovers.keep_current()
            if problem is not None:
                outcomes = [problem] * len(group)
            elif fn.is_async:
                loop = loop or asyncio.new_event_loop()
                outcomes = _run_async(loop, fn, bound[fn.name], group, timeout_s)
            else:
                outcomes = call_sync(fn, bound[fn.name], group)
            _exit_if_forked_copy(leftovers.pid)
            leftovers.end()
            recycle = any(
                o.error_kind == "memory" for o in outcomes
            )  # its heap may be full of leaked objects
            _reply(conn, (call_id, offset, outcomes, recycle))
            if recycle:
                return
            offset += len(group)


def _exit_if_forked_copy(worker_pid: int) -> None:
    """A reward that called os.fork() returns twice; the copy must not answer on the worker's pipe (its reply
    would be taken for the next sample's) nor go on serving calls."""
    if os.getpid() != worker_pid:
        os._exit(0)
