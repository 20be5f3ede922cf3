"""Resuming an RL run from one of its checkpoints (`trainer.resume_from`).

A checkpoint folder `checkpoints/step_N/` holds the model in Hugging Face format and, in its `resume/`
subfolder, what the run needs to go on as if it had never stopped: `trainer_state.safetensors` (the
optimizer's tensors and the torch RNG state) and `run_state.json` (the step, the optimizer's schedule
position and hyper-parameters, the prompt loader's epoch, order and position, Python's RNG state). A
subfolder, so that tools which load every top-level `*.safetensors` of a model folder (ours included) see
the model alone. Both are written before the folder is renamed into place, so a checkpoint is whole or
absent. Tensors go through safetensors only.

Rollout seeds derive from the step and the trainer's shuffles from its schedule position, so a run resumed
from step N repeats steps N+1... of the uninterrupted run exactly on the same device (tested on CPU).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.errors import MilesUserError

RESUME_DIR = "resume"
TRAINER_STATE = "trainer_state.safetensors"
RUN_STATE = "run_state.json"
_FORMAT = 1
_RNG_KEY = "rng.torch"


@dataclass
class RunState:
    step: int
    """The last step the checkpoint finished; a resumed run starts at step + 1."""
    max_steps: int
    """The run's trainer.max_steps, which sized its LR schedule."""
    trainer: dict[str, Any]
    """`TorchTrainer.state_dict()`: {"tensors": ..., "meta": ...}."""
    loader: dict[str, Any]
    """`PromptLoader.state_dict()`."""
    python_rng: Any
    torch_rng: torch.Tensor


def write_run_state(
    folder: Path, step: int, max_steps: int, trainer_state: dict[str, Any], loader_state: dict[str, Any]
) -> None:
    """Write the resume files into a checkpoint folder (called on the folder before it is renamed into place)."""
    folder = folder / RESUME_DIR
    folder.mkdir()
    tensors = {**trainer_state["tensors"], _RNG_KEY: torch.get_rng_state()}
    save_file(tensors, str(folder / TRAINER_STATE), metadata={"format": "miles-trainer-state"})
    state = {
        "format": _FORMAT,
        "step": step,
        "max_steps": max_steps,
        "trainer": trainer_state["meta"],
        "loader": loader_state,
        "python_rng": random.getstate(),
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
    return RunState(
        step=int(meta["step"]),
        max_steps=int(meta["max_steps"]),
        trainer={"tensors": tensors, "meta": meta["trainer"]},
        loader=meta["loader"],
        python_rng=(version, tuple(internal), gauss),
        torch_rng=torch_rng,
    )


def restore_rng(state: RunState) -> None:
    random.setstate(state.python_rng)
    torch.set_rng_state(state.torch_rng)


def _resumable(checkpoint: Path) -> bool:
    return (checkpoint / RESUME_DIR / RUN_STATE).is_file() and (
        checkpoint / RESUME_DIR / TRAINER_STATE
    ).is_file()


def _latest(checkpoints: list[Path]) -> Path | None:
    """The checkpoint of the highest step, the newest of those on a tie (several runs)."""
    resumable = [c for c in checkpoints if _resumable(c)]
    if not resumable:
        return None
    return max(
        resumable,
        key=lambda c: (json.loads((c / RESUME_DIR / RUN_STATE).read_text())["step"], c.stat().st_mtime),
    )


def find_checkpoint(spec: str, run_dir: Path) -> Path:
    """The checkpoint folder `trainer.resume_from` names: a `checkpoints/step_N` folder, a run folder (its
    latest step), or `auto` (the latest step of the newest run beside this one, i.e. under
    outputs/<recipe>/)."""
    if spec == "auto":
        runs = [r for r in run_dir.parent.iterdir() if r.is_dir() and r.resolve() != run_dir.resolve()]
        runs.sort(key=lambda r: r.stat().st_mtime, reverse=True)
        for run in runs:
            found = _latest(list((run / "checkpoints").glob("step_*")))
            if found is not None:
                return found
        raise MilesUserError(
            f"trainer.resume_from=auto found no resumable checkpoint under {run_dir.parent} "
            f"(a run writes one every trainer.save_every steps); pass a checkpoint folder instead"
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
