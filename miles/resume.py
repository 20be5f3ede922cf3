"""Run checkpoints: writing `checkpoints/step_N/` and resuming a run from one (`trainer.resume_from`).

A checkpoint folder `checkpoints/step_N/` holds the model in Hugging Face format and, in its `resume/`
subfolder, what the run needs to go on as if it had never stopped: `trainer_state.safetensors` (the
optimizer's tensors and the torch RNG state) and `run_state.json` (the step, the optimizer's schedule
position and hyper-parameters, the prompt loader's epoch, order and position, the engine's counter for
unseeded requests, Python's RNG state, the run's config); a run that trains its draft model
(`rollout.spec_draft_train`) adds the draft in `draft/` (a draft head in `draft_head/`) and its optimizer in
`resume/draft_trainer_state.safetensors`. A
subfolder, so that tools which load every top-level `*.safetensors` of a model folder (ours included) see
the model alone. Both are written before the folder is renamed into place, so a checkpoint is whole or
absent. Tensors go through safetensors only.

Rollout seeds derive from the step and the trainer's shuffles from its schedule position, so a run resumed
from step N repeats steps N+1... of the uninterrupted run exactly on the same device (tested on CPU).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.errors import MilesUserError

RESUME_DIR = "resume"
TRAINER_STATE = "trainer_state.safetensors"
RUN_STATE = "run_state.json"
DRAFT_TRAINER_STATE = "draft_trainer_state.safetensors"
DRAFT_DIR = "draft"
"""A checkpoint's subfolder holding the online-trained draft model (Hugging Face format, no tokenizer)."""
DRAFT_HEAD_DIR = "draft_head"
"""A checkpoint's subfolder holding the online-trained draft head (miles/models/draft_head.py)."""
_FORMAT = 1
_RNG_KEY = "rng.torch"


@dataclass
class RunState:
    step: int
    """The last step the checkpoint finished; a resumed run starts at step + 1."""
    max_steps: int
    """The run's trainer.max_steps, which sized its LR schedule."""
    config: dict[str, Any]
    """The run's config (redacted), flattened to dotted keys."""
    trainer: dict[str, Any]
    """`PolicyTrainer.state_dict()`: {"tensors": ..., "meta": ...}."""
    loader: dict[str, Any]
    """`PromptLoader.state_dict()`."""
    engine: dict[str, Any]
    """`Engine.state_dict()`."""
    python_rng: Any
    torch_rng: torch.Tensor
    wandb_run_id: str | None = None
    """The W&B run the interrupted run logged to: the resumed run goes on logging to it."""
    draft: dict[str, Any] | None = None
    """The draft's trainer state when the run trained its draft model or head (`rollout.spec_draft_train`)."""


def write_run_state(
    folder: Path,
    step: int,
    config: dict[str, Any],
    trainer_state: dict[str, Any],
    loader_state: dict[str, Any],
    engine_state: dict[str, Any],
    wandb_run_id: str | None = None,
    draft_trainer_state: dict[str, Any] | None = None,
) -> None:
    """Write the resume files into a checkpoint folder (called on the folder before it is renamed into place)."""
    folder = folder / RESUME_DIR
    folder.mkdir()
    tensors = {**trainer_state["tensors"], _RNG_KEY: torch.get_rng_state()}
    save_file(tensors, str(folder / TRAINER_STATE), metadata={"format": "miles-trainer-state"})
    if draft_trainer_state is not None:
        save_file(
            draft_trainer_state["tensors"],
            str(folder / DRAFT_TRAINER_STATE),
            metadata={"format": "miles-trainer-state"},
        )
    state = {
        "format": _FORMAT,
        "step": step,
        "max_steps": int(config["trainer"]["max_steps"]),
        "recipe": config.get("recipe"),
        "config": flatten(config),
        "saved_at": time.time(),
        "trainer": trainer_state["meta"],
        "loader": loader_state,
        "engine": engine_state,
        "python_rng": random.getstate(),
        "wandb_run_id": wandb_run_id,
        "draft": draft_trainer_state["meta"] if draft_trainer_state is not None else None,
    }
    (folder / RUN_STATE).write_text(json.dumps(state))


def read_run_state(checkpoint: Path) -> RunState:
    folder = checkpoint / RESUME_DIR
    meta = json.loads((folder / RUN_STATE).read_text())
    if meta.get("format") != _FORMAT:
        raise MilesUserError(
            f"{folder / RUN_STATE} has format {meta.get('format')!r}; this miles reads {_FORMAT}"
        )
    tensors = load_file(str(folder / TRAINER_STATE))
    torch_rng = tensors.pop(_RNG_KEY)
    version, internal, gauss = meta["python_rng"]
    draft = None
    if meta.get("draft") is not None:
        draft = {"tensors": load_file(str(folder / DRAFT_TRAINER_STATE)), "meta": meta["draft"]}
    return RunState(
        step=int(meta["step"]),
        max_steps=int(meta["max_steps"]),
        config=meta.get("config", {}),
        trainer={"tensors": tensors, "meta": meta["trainer"]},
        loader=meta["loader"],
        engine=meta.get("engine", {}),  # (checkpoints written before the engine's state was kept)
        python_rng=(version, tuple(internal), gauss),
        torch_rng=torch_rng,
        wandb_run_id=meta.get("wandb_run_id"),
        draft=draft,
    )


_RESUME_MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.resume_from",
    "trainer.keep_last",
    "trainer.save_every",
    "trainer.save_final",
    "trainer.eval_every",
    "logging.",
    "placement.cpu_threads",
)
"""Settings a resumed run may change without changing what it computes next."""


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = (
                value if isinstance(value, str | int | float | bool | None) else repr(value)
            )
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: saved -> current' for every setting that differs, but those a resume may change."""
    now = flatten(current)
    keys = sorted(set(saved) | set(now))
    return [
        f"{key}: {saved.get(key)!r} -> {now.get(key)!r}"
        for key in keys
        if saved.get(key) != now.get(key) and not key.startswith(_RESUME_MAY_CHANGE)
    ]


def restore_rng(state: RunState) -> None:
    random.setstate(state.python_rng)
    torch.set_rng_state(state.torch_rng)


def _resumable(checkpoint: Path) -> bool:
    return (checkpoint / RESUME_DIR / RUN_STATE).is_file() and (
        checkpoint / RESUME_DIR / TRAINER_STATE
    ).is_file()


def _meta(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / RESUME_DIR / RUN_STATE).read_text())


def _latest(checkpoints: list[Path]) -> Path | None:
    """The checkpoint saved last (the highest step on a tie), as `auto` picks. Not simply the highest step: a
    run resumed into its own folder from an earlier checkpoint leaves the interrupted run's later ones there
    (another course of the run, whose records its metrics.jsonl no longer holds) until it saves them over."""
    resumable = [c for c in checkpoints if _resumable(c)]
    if not resumable:
        return None
    return max(resumable, key=lambda c: (_meta(c).get("saved_at", 0.0), _meta(c)["step"]))


def find_checkpoint(spec: str, run_dir: Path, recipe: str | None = None) -> Path:
    """The checkpoint folder `trainer.resume_from` names: a `checkpoints/step_N` folder, a run folder (its
    latest step), or `auto`: the last one saved, of this recipe, by the runs beside this one (under
    outputs/<recipe>/)."""
    if spec == "auto":
        found = [
            c
            for run in run_dir.parent.iterdir()
            if run.is_dir() and run.resolve() != run_dir.resolve()
            for c in (run / "checkpoints").glob("step_*")
            if _resumable(c) and _meta(c).get("recipe") == recipe
        ]
        if found:
            return max(found, key=lambda c: _meta(c).get("saved_at", 0.0))
        raise MilesUserError(
            f"trainer.resume_from=auto found no resumable checkpoint of recipe {recipe!r} under "
            f"{run_dir.parent} (a run writes one every trainer.save_every steps); pass a checkpoint folder instead"
        )
    path = Path(spec).expanduser()
    if _resumable(path):
        return path
    found = _latest(list((path / "checkpoints").glob("step_*"))) if path.is_dir() else None
    if found is not None:
        return found
    if (path / "config.json").is_file():
        raise MilesUserError(
            f"{path} is a model checkpoint without the trainer's state ({RESUME_DIR}/); to start a new run "
            f"from its weights, pass model.path={path} instead of trainer.resume_from"
        )
    raise MilesUserError(
        f"trainer.resume_from={spec!r} is neither a checkpoint folder (checkpoints/step_N with {RESUME_DIR}/) "
        "nor a run folder holding one"
    )


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: object,
    run_dir: Path,
    step: int,
    write_extra: Callable[[Path], None] | None = None,
    keep_last: int = 0,
) -> Path:
    """Write `checkpoints/step_N/` (atomically, removing what earlier saves cut short left); with `keep_last`
    > 0, then remove all but the newest `keep_last` step folders."""
    from miles.models import save_pretrained

    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    # What a save cut short (killed, disk full) left: this run holds its folder, so no other save is running.
    for partial in folder.parent.glob(".step_*.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)
    saved = save_pretrained(model, folder, tokenizer=tokenizer, write_extra=write_extra)
    if keep_last > 0:
        steps = sorted(
            (p for p in folder.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),  # by number: names past 6 digits sort wrongly as text
        )
        for old in steps[:-keep_last]:
            if old != saved:
                shutil.rmtree(old, ignore_errors=True)
    return saved
