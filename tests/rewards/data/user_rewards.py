"""Reward plugins in every supported form, plus hostile ones, for tests/rewards/ (loaded by file path or,
with this folder on sys.path, as the module `user_rewards`)."""

from __future__ import annotations

import asyncio
import math
import os
import time

from miles.sample import Sample

LEAKED: list[bytes] = []


def sync_reward(sample: Sample, bonus: float = 0.0) -> float:
    return float(sample.response_text == str(sample.label)) + bonus


async def async_reward(sample: Sample) -> float:
    await asyncio.sleep(0.01)
    return float(len(sample.response_text))


def batched_reward(samples: list[Sample]) -> list[float]:
    return [float(i) for i in range(len(samples))]


def dict_reward(sample: Sample) -> dict:
    return {"score": 0.5, "length": len(sample.response_text), "tag": sample.response_text[:3]}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's signature, unannotated
    bonus = (extra_info or {}).get("bonus", 0.0)
    return (
        (1.0 if solution_str.strip() == ground_truth else 0.0)
        + bonus
        + (0.25 if data_source == "gsm8k" else 0.0)
    )


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [
        {"score": float(s == g), "source": d} for d, s, g in zip(data_sources, solution_strs, ground_truths)
    ]


class ScaledLength:
    """A class reward: built once per process with its kwargs."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.pid = os.getpid()

    def __call__(self, sample: Sample) -> dict:
        return {"score": self.scale * len(sample.response_text), "pid": self.pid}


class _SlowEngine:
    """Stands in for an engine: one generate call takes `seconds`; two threads inside it at once is a bug."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.inside, self.overlapped = seconds, 0, False

    def generate(self, prompts: list, params: object = None) -> list:
        self.inside += 1
        self.overlapped = self.overlapped or self.inside > 1
        time.sleep(self.seconds)
        self.inside -= 1
        return prompts


class SlowJudge:
    """A reward that drives an engine (as the judge does), slower than the test's reward.timeout_s."""

    def __init__(self, seconds: float = 0.6) -> None:
        self.engine = _SlowEngine(seconds)

    def __call__(self, sample: Sample) -> dict:
        self.engine.generate([sample.response_text])
        return {"score": 1.0, "overlapped": self.engine.overlapped}


def selective(sample: Sample) -> float:
    """Misbehaves according to the response text."""
    action = sample.response_text
    if action == "raise":
        raise ValueError("this reward raised on purpose")
    if action == "nan":
        return math.nan
    if action == "inf":
        return -math.inf
    if action == "sleep":
        time.sleep(60)
    if action == "string":
        return "1.0"  # type: ignore[return-value]
    if action == "nodict":
        return {"value": 1.0}  # type: ignore[return-value]
    if action == "exit":
        os._exit(3)
    if action == "huge":
        return float(len(b"x" * (10 << 30)))
    if action == "leak":
        LEAKED.append(b"x" * (100 << 20))
    return 1.0


async def async_selective(sample: Sample) -> float:
    if sample.response_text == "sleep":
        await asyncio.sleep(60)
    if sample.response_text == "raise":
        raise RuntimeError("async reward raised on purpose")
    return 1.0


async def blocks_the_loop(sample: Sample) -> float:
    time.sleep(4.0)  # sync work inside async def: the runner must abandon its event loop, not hang
    return 1.0


def not_a_reward() -> float:
    return 1.0


NOT_CALLABLE = 3


def logged_reward(sample: Sample, log_dir: str = "") -> float:
    """Writes a file named after the response when it scores it (proves when a worker ran it)."""
    with open(os.path.join(log_dir, f"scored-{sample.response_text}"), "w") as f:
        f.write(str(time.time()))
    return float(len(sample.response_text))
