"""Where configs and recipes live (inside the installed package) and how overrides are checked up front."""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from miles.config.schema import MilesConfig
from miles.errors import MilesUserError

GROUPS = ("model", "data", "rollout", "trainer", "algorithm", "reward", "placement", "logging")


def configs_dir() -> Path:
    return Path(str(resources.files("miles.configs")))


def recipes_dir() -> Path:
    return Path(str(resources.files("miles.recipes")))


def list_recipes() -> dict[str, str]:
    """Recipe name -> its first comment line."""
    recipes = {}
    for file in sorted(recipes_dir().glob("*.yaml")):
        first = file.read_text().splitlines()[0] if file.read_text() else ""
        recipes[file.stem] = first.lstrip("# ").strip()
    return recipes


def list_group_options(group: str) -> list[str]:
    return sorted(f.stem for f in (configs_dir() / group).glob("*.yaml"))


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="miles_schema", node=MilesConfig)


def _field_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _is_open_dict(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is dict:
        return True
    return any(typing.get_origin(a) is dict for a in typing.get_args(tp))


def check_key(dotted: str) -> bool:
    """Raise MilesUserError naming the valid keys when `dotted` is not a field of MilesConfig; True when it
    is a free-form dict field (`reward.kwargs`) or a key inside one (`reward.kwargs.target_len`)."""
    cls: Any = MilesConfig
    walked: list[str] = []
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(walked) or "the top level"
            raise MilesUserError(
                f"unknown config key {dotted!r}: {where} has no {part!r}. Valid keys under {where}: {', '.join(names)}"
            )
        tp = _field_type(cls, part)
        if _is_open_dict(tp):
            return True
        cls = tp
        walked.append(part)
    return False


def check_overrides(overrides: list[str]) -> list[str]:
    """Validate key=value overrides and group choices before Hydra runs, so errors list the valid names.

    Returns the overrides to hand to Hydra: a plain `key=value` that sets a free-form dict field or a key
    inside one (`reward.kwargs.target_len=128`, `reward.weights={math: 1.0}`) becomes `++key=value`, since
    Hydra's struct mode refuses new keys in a dict the config does not hold yet ("Key ... is not in struct").
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # Hydra's parse errors carry a readable message
        raise MilesUserError(str(e).splitlines()[0]) from e
    out = list(overrides)
    for i, override in enumerate(parsed):
        key = override.key_or_group
        if key.startswith("hydra") or override.is_delete():
            continue
        if key in GROUPS and not override.is_add() and not override.is_force_add():
            if isinstance(override.value(), str) and override.is_sweep_override() is False:
                options = list_group_options(key)
                if override.value() not in options:
                    raise MilesUserError(
                        f"no {key} option {override.value()!r}; available: {', '.join(options)}"
                    )
            continue
        # Checked with `+`/`++` too: outside a free-form dict the schema has no room for a new key, and Hydra
        # would let `+trainer.lerning_rate=1` through, silently unused.
        if check_key(key) and not override.is_add() and not override.is_force_add():
            out[i] = "++" + overrides[i]
    return out
