"""Greedy evaluation on a held-out split: `eval/accuracy` (reward above 0.5 counts as correct)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from miles.sample import Sample


def evaluate(
    generate: Callable[[list[Sample], Any], list[Sample]],
    rewards: object,
    prompts: list[Sample],
    max_new_tokens: int,
    stop_token_ids: list[int],
    stop: list[str],
) -> tuple[dict[str, float], list[Sample]]:
    from miles.rollout import SamplingParams

    if not prompts:
        return {}, []
    start = time.perf_counter()
    params = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, stop=stop
    )
    samples = generate(prompts, params)  # Engine.generate, or a generate plugin's (rollout.generate_fn)
    reward_metrics = rewards.score(samples)
    correct = sum(1 for s in samples if s.reward > 0.5)
    return {
        "eval/accuracy": correct / len(samples),
        "eval/reward_mean": reward_metrics.get("reward/mean", 0.0),
        "eval/response_length": sum(s.response_length for s in samples) / len(samples),
        "eval/num_samples": float(len(samples)),
        "time/eval": time.perf_counter() - start,
    }, samples
