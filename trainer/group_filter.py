"""Dynamic sampling (DAPO): train only on the groups a filter keeps, topping the step up with more prompts.

A GRPO group whose samples all score the same has zero advantage everywhere: it adds no gradient, yet it
counts in a token-mean loss's denominator and shrinks the useful batch as the policy gets better (or stays
hopeless on hard prompts). With `algorithm.group_filter` set, the loop scores each batch of prompts, keeps the
groups the filter accepts, and generates further batches from the prompt loader until it holds
`rollout.rollout_batch_size` kept groups or has generated `algorithm.filter_max_batches` batches.

A filter is `fn(group: list[Sample]) -> bool`, called on one prompt's scored samples (all ranks' samples of
it, in index order); `nonzero_std` is DAPO's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from miles import plugins
from miles.distributed import combine_metrics
from miles.errors import MilesUserError
from miles.sample import Sample, SampleStatus

GroupFilter = Callable[[list[Sample]], bool]


def trainable(sample: Sample) -> bool:
    """A sample the update can use: it has a response and was not aborted."""
    return bool(sample.response_ids) and sample.status != SampleStatus.ABORTED


def nonzero_std(group: list[Sample]) -> bool:
    """Keep a group whose trainable samples' rewards are not all equal (DAPO's filter): the others' GRPO
    advantages are all 0."""
    return len({float(s.reward) for s in group if trainable(s)}) > 1


BUILTIN_FILTERS: dict[str, GroupFilter] = {"nonzero_std": nonzero_std}


def load_group_filter(spec: str) -> GroupFilter | None:
    """The filter `algorithm.group_filter` names: a built-in name, `pkg.mod:func` or `path/file.py:func`;
    None for "" (dynamic sampling off)."""
    spec = spec.strip()
    if not spec:
        return None
    if spec in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[spec]
    if ":" not in spec:
        raise MilesUserError(
            f"algorithm.group_filter {spec!r}: use a built-in ({', '.join(BUILTIN_FILTERS)}), "
            "'package.module:function' or 'path/to/file.py:function' (or '' for no filter)"
        )
    fn = plugins.load(plugins.normalize(spec, "algorithm.group_filter"), "algorithm.group_filter")
    if not callable(fn):
        raise MilesUserError(f"algorithm.group_filter {spec!r} is not callable")
    return fn


def kept_groups(samples: list[Sample], keep: GroupFilter) -> list[int]:
    """The group ids of `samples` (in order of first appearance) whose groups `keep` accepts."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    kept = []
    for group_id, members in groups.items():
        verdict = keep(sorted(members, key=lambda s: s.index))
        if not isinstance(verdict, bool | np.bool_):
            raise TypeError(
                f"algorithm.group_filter returned {type(verdict).__name__} for group {group_id}; it must "
                "return True (train on the group) or False"
            )
        if verdict:
            kept.append(group_id)
    return kept


def filter_metrics(samples: list[Sample], kept: list[int], batches: int, wanted: int) -> dict[str, float]:
    """`rollout/filter_*` of a step: the batches generated, the groups trained on (at most `wanted`) and the
    share of generated groups the filter dropped."""
    generated = len({s.group_id for s in samples})
    return {
        "rollout/filter_batches": float(batches),
        "rollout/filter_kept_groups": float(min(len(kept), wanted)),
        "rollout/filter_dropped_frac": 1.0 - len(kept) / max(generated, 1),
    }


_RUN_TOTALS = ("reward/worker_restarts",)
"""Reward metrics that count over the whole run, not one batch: the last batch's value stands."""


def combine_round_metrics(rounds: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """The reward metrics of a step's batches (each batch's, with its number of samples) as one set: means
    weighted by samples, std pooled, errors and counts added (the same rules as across ranks)."""
    merged = combine_metrics([m for m, _ in rounds], [w for _, w in rounds])
    for key in _RUN_TOTALS:
        if key in rounds[-1][0]:
            merged[key] = rounds[-1][0][key]
    return merged
