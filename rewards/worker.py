"""The reward worker process's main loop.

This module is preloaded in the multiprocessing fork server, so the heavy grader dependencies (math-verify / sympy)
are imported once there and every worker forked from it starts warm.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection

import math_verify  # noqa: F401  (preloaded: see the module docstring)

from miles.rewards.calls import call_sync
from miles.rewards.loading import BoundReward, RewardFunction, bind
from miles.rewards.outcome import RewardOutcome, failure, outcome_from_exception


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


def worker_main(conn: Connection, memory_mb: int) -> None:
    """Receives ("bind", RewardFunction) or (call_id, RewardFunction, samples).

    A bind builds the reward (a class reward's constructor may load a model) and replies ("bound", name, failure
    or None); the pool times it with its own, generous deadline (pool.BIND_TIMEOUT_S), so the per-sample clock
    of reward.timeout_s starts only once the reward exists. A call replies (call_id, offset, outcomes, recycle)
    after each sample (once for a batched reward), so the parent can time each sample while the worker moves
    straight on to the next. None or EOF stops it. Rewards run on this process's main thread, so signal-based
    timeouts work. The worker leads a process group of its own, so the pool can kill whatever a reward started
    (a checker, a compiler) together with it."""
    try:
        os.setsid()
    except OSError:  # already a group leader (never under multiprocessing): the pool kills just this pid then
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pool
    _limit_address_space(memory_mb)
    bound: dict[str, BoundReward] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "bind":
            fn = message[1]
            conn.send(("bound", fn.name, _bind_once(bound, fn)))
            continue
        call_id, fn, samples = message
        groups = [samples] if fn.batched else [[s] for s in samples]
        offset = 0
        for group in groups:
            problem = _bind_once(bound, fn)  # normally bound already, by a bind message
            outcomes = [problem] * len(group) if problem is not None else call_sync(fn, bound[fn.name], group)
            recycle = any(
                o.error_kind == "memory" for o in outcomes
            )  # its heap may be full of leaked objects
            _reply(conn, (call_id, offset, outcomes, recycle))
            if recycle:
                return
            offset += len(group)
