"""The reward worker process's main loop.

This module is preloaded in the multiprocessing fork server, so the heavy grader dependencies (math-verify / sympy)
are imported once there and every worker forked from it starts warm.
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection

import math_verify  # noqa: F401  (preloaded: see the module docstring)

from miles.rewards.calls import call_sync
from miles.rewards.loading import BoundReward, bind
from miles.rewards.outcome import failure, outcome_from_exception


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


def worker_main(conn: Connection, memory_mb: int) -> None:
    """Receives (call_id, RewardFunction, samples); replies (call_id, offset, outcomes, recycle) after each sample
    (once for a batched reward), so the parent can time each sample while the worker moves straight on to the
    next. None or EOF stops it. Rewards run on this process's main thread, so signal-based timeouts work."""
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
        call_id, fn, samples = message
        groups = [samples] if fn.batched else [[s] for s in samples]
        offset = 0
        for group in groups:
            try:
                if fn.name not in bound:
                    bound[fn.name] = bind(fn)
                outcomes = call_sync(fn, bound[fn.name], group)
            except BaseException as e:  # building the reward (a class constructor) is user code too
                outcomes = [outcome_from_exception(e)] * len(group)
            recycle = any(
                o.error_kind == "memory" for o in outcomes
            )  # its heap may be full of leaked objects
            _reply(conn, (call_id, offset, outcomes, recycle))
            if recycle:
                return
            offset += len(group)
