"""Calling a bound reward and turning whatever happens into outcomes; used by the worker processes and by the
in-process executor alike."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from miles.rewards.loading import BoundReward, RewardFunction
from miles.rewards.outcome import (
    RewardOutcome,
    failure,
    outcome_from_exception,
    outcome_from_value,
    outcomes_from_batch,
)
from miles.sample import Sample


def to_outcomes(fn: RewardFunction, value: Any, count: int) -> list[RewardOutcome]:
    return outcomes_from_batch(value, count) if fn.batched else [outcome_from_value(value)]


async def _await(value: Any) -> Any:
    return await value


def call_sync(fn: RewardFunction, bound: BoundReward, samples: list[Sample]) -> list[RewardOutcome]:
    """Runs a reward on this thread; never raises for anything the reward does."""
    try:
        value = bound.call(samples)
        if inspect.isawaitable(value):  # a plain function that returned a coroutine
            value = asyncio.run(_await(value))
        return to_outcomes(fn, value, len(samples))
    except BaseException as e:  # user code: whatever it raises (SystemExit included) costs only these samples
        return [outcome_from_exception(e)] * len(samples)


async def call_async(
    fn: RewardFunction, bound: BoundReward, samples: list[Sample], timeout_s: float
) -> list[RewardOutcome]:
    """Runs an async reward with a timeout; never raises for anything the reward does."""
    try:
        task = asyncio.ensure_future(bound.call(samples))
    except BaseException as e:  # the call itself failed before returning a coroutine
        return [outcome_from_exception(e)] * len(samples)
    loop = asyncio.get_running_loop()
    start = loop.time()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done or loop.time() - start > timeout_s:  # the second case: it blocked the loop past its deadline
        task.cancel()
        return [failure("timeout", f"took longer than {timeout_s:g} s (reward.timeout_s)")] * len(samples)
    try:
        return to_outcomes(fn, task.result(), len(samples))
    except asyncio.CancelledError:
        return [failure("cancelled", "cancelled at shutdown")] * len(samples)
    except BaseException as e:  # user code
        return [outcome_from_exception(e)] * len(samples)
