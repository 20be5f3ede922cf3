"""`miles train`: an argparse-style front over Hydra.

`recipe=NAME` picks `recipes/NAME.yaml` as the primary config; everything else is a Hydra override, so
`--cfg job`, `-m` (multirun) and `hydra.run.dir=...` behave as in any Hydra app. Overrides are checked
against the typed schema first, so a typo fails with the list of valid keys instead of a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from miles.config.store import (
    GROUPS,
    check_overrides,
    configs_dir,
    list_group_options,
    list_recipes,
    recipes_dir,
    register_schema,
)
from miles.errors import MilesUserError
from miles.run_dir import claim_default

DEFAULT_RECIPE = "grpo_math"
NO_RUN_FLAGS = {
    "-m",
    "--multirun",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--hydra-help",
    "--resolve",
    "--package",
    "-p",
}
"""Hydra flags under which no run folder of the default name is written (sweeps name their own)."""


def help_text() -> str:
    lines = [
        "usage: miles train [recipe=NAME] [group=option ...] [key=value ...] [--cfg job] [-m]",
        "",
        "Runs one RL (or SFT) job; writes outputs/<recipe>/<date_time>/ (override with hydra.run.dir=DIR).",
        "",
        "recipes (recipe=NAME):",
    ]
    lines += [f"  {name:<20} {desc}" for name, desc in list_recipes().items()]
    lines += ["", "config groups (group=option):"]
    lines += [f"  {group:<10} {', '.join(list_group_options(group))}" for group in GROUPS]
    lines += [
        "",
        "common overrides:",
        "  trainer.max_steps=N  trainer.lr=X  rollout.n_samples_per_prompt=N  model.path=DIR  data.path=FILE",
        "  reward.fn=pkg.mod:func  logging.wandb=false  hydra.run.dir=DIR",
        "  placement.num_processes=N   N data-parallel processes, one device each (or run under torchrun)",
        "",
        "  --cfg job       print the resolved config and exit",
        "  -m, --multirun  sweep: e.g. -m trainer.lr=1e-5,1e-4",
        "  --hydra-help    Hydra's own help",
    ]
    return "\n".join(lines)


def split_args(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(recipe, hydra flags, key=value overrides)."""
    recipe, flags, overrides = DEFAULT_RECIPE, [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg in ("--cfg", "-c", "--package", "-p", "--info"):
            flags.append(arg)
            if i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
                flags.append(argv[i + 1])
                i += 1
        elif arg.startswith("-"):
            flags.append(arg)
        else:
            overrides.append(arg)
        i += 1
    return recipe, flags, overrides


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    recipe, flags, overrides = split_args(argv)
    recipes = list_recipes()
    if recipe not in recipes:
        raise MilesUserError(f"unknown recipe {recipe!r}; available: {', '.join(recipes)}")
    overrides = check_overrides(overrides)
    register_schema()

    import hydra

    from miles.run import run_from_hydra

    if (
        not any(o.lstrip("+~").startswith("hydra.run.dir=") for o in overrides)
        and not set(flags) & NO_RUN_FLAGS
    ):
        # Hydra's default name is the second's: two runs started in one second would share it.
        overrides.append(f"hydra.run.dir={claim_default(Path('outputs') / recipe)}")
    hydra_argv = [
        "miles train",
        "--config-name",
        recipe,
        *flags,
        f"hydra.searchpath=[file://{configs_dir()}]",
        # Hydra's .hydra/ copies of the config and the command line would hold API keys in plain text; the run
        # folder's config.yaml is the resolved config, with its secrets masked.
        *(
            []
            if any(o.lstrip("+~").startswith("hydra.output_subdir=") for o in overrides)
            else ["hydra.output_subdir=null"]
        ),
        *overrides,
    ]
    task = hydra.main(version_base="1.3", config_path=str(recipes_dir()), config_name=recipe)(run_from_hydra)
    saved_argv = sys.argv
    sys.argv = hydra_argv
    try:
        task()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except ValueError as e:  # Hydra's own argument errors (e.g. --cfg with -m)
        raise MilesUserError(str(e)) from e
    finally:
        sys.argv = saved_argv
    return 0
