"""The algorithm registry: advantage estimators and policy losses by name (or `pkg.mod:func`).

    from miles.trainer.algorithms import register_advantage

    @register_advantage("my_adv")
    def my_adv(samples, cfg) -> list[float]: ...

then `algorithm.advantage=my_adv` (after importing the module) or `algorithm.advantage=pkg.mod:my_adv`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from miles.config import AlgorithmConfig
from miles.sample import Sample
from miles.trainer import advantages as _advantages  # noqa: F401  (registers the built-in estimators)
from miles.trainer import losses as _losses  # noqa: F401  (registers the built-in losses)
from miles.trainer.advantages import group_indices
from miles.trainer.losses import PolicyLossInput, PolicyLossOutput
from miles.trainer.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    lookup,
    register_advantage,
    register_policy_loss,
)

AdvantageFn = Callable[[list[Sample], AlgorithmConfig], "list[float]"]
PolicyLossFn = Callable[[PolicyLossInput, AlgorithmConfig], PolicyLossOutput]

__all__ = [
    "AdvantageFn",
    "PolicyLossFn",
    "PolicyLossInput",
    "PolicyLossOutput",
    "compute_advantages",
    "get_advantage",
    "get_policy_loss",
    "list_advantages",
    "list_policy_losses",
    "register_advantage",
    "register_policy_loss",
]


def get_advantage(name: str) -> AdvantageFn:
    """A registered estimator by name, or a custom one by dotted path `pkg.mod:func`."""
    return lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """A registered policy loss by name, or a custom one by dotted path `pkg.mod:func`."""
    return lookup(POLICY_LOSSES, "policy loss", name)


def list_advantages() -> list[str]:
    return sorted(ADVANTAGE_ESTIMATORS)


def list_policy_losses() -> list[str]:
    return sorted(POLICY_LOSSES)


def compute_advantages(samples: list[Sample], cfg: AlgorithmConfig) -> dict[str, float]:
    """Set `sample.advantage` on every sample with `cfg.advantage`; return `adv/*` metrics."""
    if not samples:
        return {}
    values = list(get_advantage(cfg.advantage)(samples, cfg))
    if len(values) != len(samples):
        raise ValueError(
            f"advantage estimator {cfg.advantage!r} returned {len(values)} values for {len(samples)} samples"
        )
    for sample, value in zip(samples, values):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(
                f"advantage estimator {cfg.advantage!r} returned a non-finite advantage ({value})"
            )
        sample.advantage = value
    groups = group_indices(samples)
    zero_std = sum(1 for idx in groups if len({float(samples[i].reward) for i in idx}) == 1)
    n = len(values)
    mean = sum(float(v) for v in values) / n
    return {
        "adv/mean": mean,
        "adv/std": math.sqrt(sum((float(v) - mean) ** 2 for v in values) / n),
        "adv/min": float(min(values)),
        "adv/max": float(max(values)),
        "adv/zero_std_frac": zero_std / len(groups),
        "adv/num_groups": float(len(groups)),
    }
