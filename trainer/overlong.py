"""DAPO's soft overlong punishment (`algorithm.overlong_buffer`): a reward penalty for responses that run into
the last `buffer` tokens of `max_new_tokens`, growing linearly to `penalty` at the limit, so that truncated,
rambling responses are discouraged without the cliff of scoring every truncated sample 0.

The loop applies it after the group filter (which judges the rewards as scored, as verl's `filter_groups`
with its accuracy metric does) and before the advantages.
"""

from __future__ import annotations

from miles.sample import Sample


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """0 up to `max_length - buffer` tokens, then -penalty * (tokens past it) / buffer, -penalty at most."""
    over = length - (max_length - buffer)
    return 0.0 if over <= 0 else -penalty * min(over / buffer, 1.0)


def apply_overlong_penalty(
    samples: list[Sample], max_length: int, buffer: int, penalty: float
) -> dict[str, float]:
    """Add each sample's penalty to its reward (kept in `reward_info["overlong_penalty"]`); returns
    `reward/overlong_penalty_mean` and `reward/overlong_frac` (the share of samples penalised)."""
    values = []
    for sample in samples:
        value = overlong_penalty(sample.response_length, max_length, buffer, penalty)
        sample.reward += value
        sample.reward_info["overlong_penalty"] = value
        values.append(value)
    count = max(len(values), 1)
    return {
        "reward/overlong_penalty_mean": sum(values) / count,
        "reward/overlong_frac": sum(v < 0 for v in values) / count,
    }
