"""A step's metrics and samples from every rank's to one set: counts add, durations take the longest rank's,
means are weighted by what each rank measured them over."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from miles.distributed.comm import DataParallel
from miles.sample import Sample

_SUMMED_ENDINGS = (
    "errors",
    "timeouts",
    "/aborted",
    "/truncated",
    "restarts",
    "/dropped_samples",
    "/dropped_rows",
    "/preemptions",
    "/num_samples",
    "/num_groups",
    "/count",
    "tokens",
    "tokens_per_s",
    "bytes",
    "_steps",
    "_drafts",
)
"""Counts and rates: each rank's is its part of the whole, so they add (N engines make N times the tokens)."""

_LARGEST_ENDINGS = ("/max", "_peak", "_s", "seconds")
"""Maxima, peaks and durations (`rollout/decode_s`): the ranks run at the same time, so the step lasts the
longest rank's."""

_WEIGHTED_BY = {
    "rollout/prefix_hit_rate": "rollout/prompt_tokens",
    "rollout/spec_accept_length": "rollout/spec_steps",
    # means over samples, where a generate plugin's prompt may give several (`eval/count` counts prompts)
    "eval/reward_mean": "eval/num_samples",
    "eval/response_length": "eval/num_samples",
}
"""Means over something other than samples: each rank's weighs by its count of that."""


def combine_metrics(per_rank: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    """One metric set from each rank's, for the metrics a rank measures on its own share of the step:
    counts and rates add, maxima, peaks and durations (`time/*`, `memory/*`, `*_s`) take the largest,
    `/min` the smallest, and every other value is a mean over the ranks weighted by `weights` (their numbers of
    samples), or by `P/count` for the keys under `P/` where the ranks report one (by `_WEIGHTED_BY`'s count
    for the keys it names); a `/std` is pooled with its `/mean`. A key some rank lacks is combined over the
    ranks that have it."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    keys = list(dict.fromkeys(k for metrics in per_rank for k in metrics))
    out: dict[str, float] = {}
    for key in keys:
        prefix = key.rsplit("/", 1)[0]
        have = [
            (float(m[key]), _weight(m, key, prefix, w), m)
            for m, w in zip(per_rank, weights)
            if m.get(key) is not None
        ]
        if not have:
            continue
        values = [v for v, _, _ in have]
        total = sum(w for _, w, _ in have)
        if key.endswith(_SUMMED_ENDINGS):
            out[key] = sum(values)
        elif key.endswith(_LARGEST_ENDINGS) or key.startswith(("time/", "memory/")):
            out[key] = _extreme(values, max)
        elif key.endswith("/min"):
            out[key] = _extreme(values, min)
        elif total <= 0:
            out[key] = sum(values) / len(values)
        else:
            # A rank with nothing to weigh (no samples) says nothing about a mean, whatever it reports (NaN).
            have = [h for h in have if h[1] != 0]
            if key.endswith("/std") and all(m.get(f"{prefix}/mean") is not None for _, _, m in have):
                mean = sum(float(m[f"{prefix}/mean"]) * w for _, w, m in have) / total
                second = sum((sd * sd + float(m[f"{prefix}/mean"]) ** 2) * w for sd, w, m in have) / total
                out[key] = math.sqrt(max(second - mean * mean, 0.0))
            else:
                out[key] = sum(v * w for v, w, _ in have) / total
    return out


def _extreme(values: list[float], pick: Callable[[list[float]], float]) -> float:
    """The largest or smallest value, NaN when any rank's is (Python's max and min keep or drop a NaN by
    its position, so a NaN on one rank would show or vanish with the ranks' order)."""
    return math.nan if any(math.isnan(v) for v in values) else pick(values)


def _weight(metrics: dict[str, float], key: str, prefix: str, default: float) -> float:
    count = metrics.get(_WEIGHTED_BY.get(key, f"{prefix}/count"))
    return default if count is None else float(count)


def reduce_metrics(dp: DataParallel, metrics: dict[str, float], weight: float) -> dict[str, float]:
    """`combine_metrics` over every rank's `metrics`, on every rank."""
    if not dp.enabled:
        return metrics
    gathered = dp.all_gather_objects((metrics, float(weight)))
    return combine_metrics([m for m, _ in gathered], [w for _, w in gathered])


def gather_samples(dp: DataParallel, samples: list[Sample]) -> tuple[list[Sample], int]:
    """Every rank's samples in rank order, and where this rank's begin in that list. With one process the
    list is `samples` itself; otherwise copies without the per-token logprobs and recorded routing (the
    batch-wide views, advantages and logs, do not read them)."""
    if not dp.enabled:
        return samples, 0
    slim = [replace(s, rollout_logprobs=[], routed_experts=None) for s in samples]
    parts = dp.all_gather_objects(slim)
    offset = sum(len(part) for part in parts[: dp.rank])
    return [s for part in parts for s in part], offset
