"""Greedy evaluation on a held-out split: `eval/accuracy` (reward above 0.5 counts as correct)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
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
    """One greedy sample per prompt through `generate` (`Engine.generate`, or a generate plugin's
    `MultiTurnRollout.generate`), scored by `rewards`.

    `eval/accuracy` is the fraction of prompts (eval problems) answered correctly. A generate plugin may
    return several samples for one prompt: the turns of one trajectory, one sample per turn (README,
    "Multi-turn rollouts"), so the prompt's last sample, where the trajectory ends, decides: its reward above
    0.5 counts the prompt correct. `eval/reward_mean` and `eval/response_length` are means over samples,
    `eval/num_samples` counts samples and `eval/count` prompts. The samples come back with `group_id` set
    to their prompt's position in `prompts`."""
    from miles.rollout import SamplingParams

    if not prompts:
        return {}, []
    start = time.perf_counter()
    params = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, stop=stop
    )
    # Held-out prompts share group_id 0; each gets its own so a plugin's samples can be told apart by prompt.
    prompts = [replace(p, group_id=i) for i, p in enumerate(prompts)]
    samples = generate(prompts, params)
    reward_metrics = rewards.score(samples)
    last: dict[int, Sample] = {}
    for s in samples:  # in order (prompt-major), so a prompt's last sample is its trajectory's end
        last[s.group_id] = s
    correct = sum(1 for s in last.values() if s.reward > 0.5)
    return {
        "eval/accuracy": correct / len(prompts),
        "eval/reward_mean": reward_metrics.get("reward/mean", 0.0),
        "eval/response_length": sum(s.response_length for s in samples) / len(samples),
        "eval/num_samples": float(len(samples)),
        # Data-parallel ranks' eval/* means are weighted by this (miles.distributed.combine_metrics), so the
        # accuracy over all ranks stays per prompt.
        "eval/count": float(len(prompts)),
        "time/eval": time.perf_counter() - start,
    }, samples
