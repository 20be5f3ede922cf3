"""`RewardOutcome`: what one reward call produced for one sample, with every way user code can go wrong folded
into a score of 0 and an error kind."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Any

ERROR_KINDS = ("exception", "timeout", "nan", "bad_return", "memory", "crash", "cancelled")
MAX_EXTRA_DEPTH = 4
MAX_ABS_SCORE = 1e30
"""A finite score beyond this is a bug in the reward (1e308 would overflow the batch's mean and dwarf every other
sample's advantage): it costs that sample as a `bad_return`."""


@dataclass
class RewardOutcome:
    score: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    """The fields of a dict return other than `score` (JSON-friendly copies)."""
    error_kind: str | None = None
    """One of ERROR_KINDS when the call failed (the score is then 0)."""
    error: str | None = None
    """One line saying what went wrong."""
    traceback: str | None = None

    @property
    def failed(self) -> bool:
        return self.error_kind is not None


def failure(kind: str, message: str, tb: str | None = None) -> RewardOutcome:
    return RewardOutcome(0.0, {}, kind, message, tb)


def plain(value: Any, depth: int = 0) -> Any:
    """A JSON-friendly, picklable copy of a logged extra field (numpy / torch scalars become numbers)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
        try:
            return plain(value.item(), depth)
        except (TypeError, ValueError, RuntimeError):
            pass
    if depth < MAX_EXTRA_DEPTH:
        if isinstance(value, dict):
            return {str(k): plain(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v, depth + 1) for v in value]
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _to_score(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def outcome_from_value(value: Any) -> RewardOutcome:
    """float / int / bool / numpy or torch scalar, or a dict holding `score` (the other keys are logged)."""
    extras: dict[str, Any] = {}
    raw = value
    if isinstance(value, dict):
        if "score" not in value:
            return failure(
                "bad_return",
                f"returned a dict without 'score' (keys: {sorted(map(str, value))[:10]}); "
                "return a float or a dict with a 'score' entry",
            )
        raw = value["score"]
        extras = {str(k): plain(v) for k, v in value.items() if k != "score"}
    score = _to_score(raw)
    if score is None:
        return failure(
            "bad_return",
            f"returned {type(raw).__name__} {plain(raw)!r}; return a float or a dict with a 'score' entry",
        )
    if not math.isfinite(score):
        return RewardOutcome(0.0, extras, "nan", f"returned a non-finite score ({score})")
    if abs(score) > MAX_ABS_SCORE:
        return RewardOutcome(
            0.0,
            extras,
            "bad_return",
            f"returned {score:g}, beyond ±{MAX_ABS_SCORE:g}; return a bounded score",
        )
    return RewardOutcome(score, extras)


def outcomes_from_batch(values: Any, expected: int) -> list[RewardOutcome]:
    """A batched reward must return one value per sample, in order."""
    if hasattr(values, "tolist") and not isinstance(values, list):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        return [
            failure(
                "bad_return",
                f"a batched reward returned {type(values).__name__}; return a list with one score per sample",
            )
        ] * expected
    if len(values) != expected:
        return [
            failure("bad_return", f"a batched reward returned {len(values)} scores for {expected} samples")
        ] * expected
    return [outcome_from_value(v) for v in values]


def outcome_from_exception(exc: BaseException) -> RewardOutcome:
    kind = "memory" if isinstance(exc, MemoryError) else "exception"
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return failure(kind, message, tb)
