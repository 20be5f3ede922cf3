"""Finding a reward by name and adapting it to one calling convention.

A spec is a built-in name (BUILTINS), a dotted path `package.module:attr` or a file path `path/to/file.py:attr`.
The attribute is a function, a callable object, or a class (instantiated once per process with the reward's
kwargs, then called). The calling convention is read from the signature:
- `f(sample, **kw) -> float | dict` (`async def` allowed), or `f(samples, **kw) -> list` when batched;
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)`, and its batched form
  `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles import plugins
from miles.errors import MilesUserError
from miles.sample import Sample

BUILTINS: dict[str, str] = {
    "math": "miles.rewards.math_grader:math_reward",
    "exact_match": "miles.rewards.text_rewards:exact_match",
    "format": "miles.rewards.text_rewards:format_reward",
    "code": "miles.rewards.code_reward:code_reward",
    "judge": "miles.rewards.judge:JudgeReward",
    "remote": "miles.rewards.remote:RemoteReward",
    "reasoning_gym": "miles.rewards.reasoning_gym_reward:ReasoningGymReward",
}
IN_PROCESS_BUILTINS = frozenset({"judge"})
"""Built-ins that must run in the trainer process (the judge drives an engine object living there)."""

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class RewardConfigError(MilesUserError):
    """The reward configuration cannot work (unknown name, missing file, bad kwargs): fix the config."""


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward: enough to call it here or to rebuild it in a worker process (which re-imports `target`)."""

    name: str
    """Metric name: reward/<name>/mean."""
    target: str
    """Importable `module:attr` or `/abs/path/file.py:attr`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False
    is_async: bool = False
    in_process: bool = False
    """A built-in that must run in the trainer (the judge drives an engine living there)."""
    user_code: bool = False
    """Not a built-in (a file or a module of the user's): it runs in worker processes unless the config says
    reward.in_process=true (runner.py)."""
    style: str = "sample"
    """sample | verl | verl_batch."""
    passes_extra_info: bool = True
    """verl styles: whether the function takes extra_info(s)."""


def normalize_spec(spec: str) -> str:
    """Built-in names become their module path; file paths become absolute (workers may run elsewhere)."""
    spec = str(spec).strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        raise RewardConfigError(
            f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTINS)}), a dotted path 'package.module:function' "
            "or a file path 'path/to/file.py:function'"
        )
    return plugins.normalize(spec, "reward", RewardConfigError)


def load_target(target: str) -> Any:
    """The function / class a normalized spec names."""
    return plugins.load(target, "reward", RewardConfigError)


def _call_parameters(target: Any) -> list[inspect.Parameter]:
    """Parameters of what gets called per sample / batch (a class's __call__ without self)."""
    try:
        if inspect.isclass(target):
            return list(inspect.signature(target.__call__).parameters.values())[1:]
        return list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError) as e:
        raise RewardConfigError(f"cannot read the signature of reward {target!r}: {e}") from e


def _is_async(target: Any) -> bool:
    if inspect.isclass(target):
        return inspect.iscoroutinefunction(target.__call__)
    if inspect.isfunction(target) or inspect.ismethod(target):
        return inspect.iscoroutinefunction(target)
    return inspect.iscoroutinefunction(type(target).__call__)


def _keyword_parameters(target: Any, data_params: set[str]) -> tuple[set[str], bool]:
    """(names the reward accepts as configuration kwargs, whether it takes **kwargs)."""
    if inspect.isclass(target):
        params = list(inspect.signature(target.__init__).parameters.values())[1:]
    else:
        params = _call_parameters(target)[0 if data_params else 1 :]
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - data_params
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def describe(
    spec: str, name: str, kwargs: dict[str, Any], batched: bool, shared_kwargs: dict[str, Any] | None = None
) -> RewardFunction:
    """Resolve `spec` and check that `kwargs` fit it (a kwarg it does not take is a config error). `shared_kwargs`
    (the common kwargs of a multi-reward config) are passed only where the reward takes them."""
    builtin = str(spec).strip() if str(spec).strip() in BUILTINS else None
    target_spec = normalize_spec(spec)
    target = load_target(target_spec)
    if not callable(target):
        raise RewardConfigError(
            f"reward {spec!r} resolves to a {type(target).__name__}, not a function or class"
        )
    param_names = {p.name for p in _call_parameters(target)}
    if set(VERL_BATCH_PARAMS[:3]) <= param_names:
        style, data_params = "verl_batch", set(VERL_BATCH_PARAMS)
    elif set(VERL_PARAMS[:3]) <= param_names:
        style, data_params = "verl", set(VERL_PARAMS)
    else:
        style, data_params = "sample", set()
    positional = [
        p
        for p in _call_parameters(target)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if style == "sample" and not positional:
        raise RewardConfigError(
            f"reward {name!r} must take the sample (or, batched, the list of samples) as its first argument"
        )
    accepted, takes_any = _keyword_parameters(target, data_params)
    unknown = sorted(set(kwargs) - accepted) if not takes_any else []
    if unknown:
        raise RewardConfigError(
            f"reward {name!r} does not take {unknown}; it takes {sorted(accepted) or 'no kwargs'}"
        )
    shared = {k: v for k, v in (shared_kwargs or {}).items() if takes_any or k in accepted}
    used = {**shared, **kwargs}
    extra_name = VERL_BATCH_PARAMS[3] if style == "verl_batch" else VERL_PARAMS[3]
    return RewardFunction(
        name=name,
        target=target_spec,
        kwargs=used,
        batched=style == "verl_batch" or (style == "sample" and (batched or builtin == "judge")),
        is_async=_is_async(target),
        in_process=builtin in IN_PROCESS_BUILTINS,
        user_code=builtin is None,
        style=style,
        passes_extra_info=extra_name in param_names
        or any(p.kind == p.VAR_KEYWORD for p in _call_parameters(target)),
    )


def accepted_kwargs(fn: RewardFunction) -> str:
    """What a resolved reward takes as configuration kwargs, for error messages: 'any' when it has **kwargs."""
    data_params = {"verl": set(VERL_PARAMS), "verl_batch": set(VERL_BATCH_PARAMS)}.get(fn.style, set())
    names, takes_any = _keyword_parameters(load_target(fn.target), data_params)
    return "any kwargs" if takes_any else str(sorted(names) or "no kwargs")


def check_shared_kwargs(shared: dict[str, Any], functions: list[RewardFunction]) -> None:
    """With several rewards, a top-level reward.kwargs key goes to the rewards that take it; one that none takes
    (a typo, or a misspelt reward namespace) would be silently dropped, so it is an error."""
    used = {key for fn in functions for key in fn.kwargs}
    unknown = sorted(set(shared) - used)
    if unknown:
        takes = "; ".join(f"{fn.name!r} takes {accepted_kwargs(fn)}" for fn in functions)
        raise RewardConfigError(
            f"reward.kwargs {unknown} is taken by none of the rewards ({takes}); fix the name, or set it for "
            "one reward as reward.kwargs.<reward name>.<key>"
        )


def _extra_info(sample: Sample) -> Any:
    return sample.metadata.get("extra_info", {})


@dataclass
class BoundReward:
    """A reward ready to call in this process: `call(samples)` returns the raw value (or a coroutine)."""

    call: Callable[[list[Sample]], Any]
    instance: Any = None
    """The object built from a class reward (closed at shutdown when it has close / aclose)."""


def bind(fn: RewardFunction) -> BoundReward:
    target = load_target(fn.target)
    kwargs = dict(fn.kwargs)
    instance = None
    if inspect.isclass(target):
        instance = target = target(**kwargs)
        kwargs = {}
    if fn.style == "verl":

        def call(samples: list[Sample]) -> Any:
            s = samples[0]
            extra = {"extra_info": _extra_info(s)} if fn.passes_extra_info else {}
            return target(
                data_source=s.data_source,
                solution_str=s.response_text,
                ground_truth=s.label,
                **extra,
                **kwargs,
            )

    elif fn.style == "verl_batch":

        def call(samples: list[Sample]) -> Any:
            extra = {"extra_infos": [_extra_info(s) for s in samples]} if fn.passes_extra_info else {}
            return target(
                data_sources=[s.data_source for s in samples],
                solution_strs=[s.response_text for s in samples],
                ground_truths=[s.label for s in samples],
                **extra,
                **kwargs,
            )

    elif fn.batched:

        def call(samples: list[Sample]) -> Any:
            return target(samples, **kwargs)

    else:

        def call(samples: list[Sample]) -> Any:
            return target(samples[0], **kwargs)

    return BoundReward(call, instance)
