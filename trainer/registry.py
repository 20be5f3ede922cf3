"""Name → function tables for advantage estimators and policy losses.

Built-ins register themselves on import of `miles.trainer.algorithms`; a user plugin either calls
`register_advantage` / `register_policy_loss` or is named in the config by its dotted path `pkg.mod:func`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered ({table[name].__module__}); pick another name"
            )
        table[name] = fn
        return fn

    return decorator


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: `@register_advantage("my_adv")` on `fn(samples, cfg) -> list[float]` (one per sample)."""
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: `@register_policy_loss("my_loss")` on `fn(batch: PolicyLossInput, cfg) -> PolicyLossOutput`."""
    return _register(POLICY_LOSSES, "policy loss", name)


def load_dotted(path: str) -> Callable:
    """Import `pkg.mod:func` (attribute path after the colon may be nested: `pkg.mod:Class.method`)."""
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{path!r} is not a dotted path; write it as 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} of {path!r}: {err}") from err
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r} (from {path!r})")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{path!r} is not callable")
    return obj


def lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    if name in table:
        return table[name]
    if ":" in name:
        return load_dotted(name)
    raise KeyError(
        f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}, or give 'package.module:function'"
    )
