"""`miles init-model`: write a randomly initialised Hugging Face checkpoint (+ tokenizer) without the hub.

    miles init-model --arch qwen3_moe --preset tiny --out DIR [--seed N] [--dtype float32|bfloat16]
    miles init-model --preset qwen3-0.6b --dtype bfloat16 --tokenizer QWEN_TOKENIZER_DIR --out DIR

The tiny presets come with the character tokenizer; the real-shape presets have no tokenizer available
offline, so pass a local one with --tokenizer or add its files to DIR afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from miles.errors import MilesUserError
from miles.models.args import SUPPORTED_MODEL_TYPES, ModelArgs
from miles.models.presets import PRESETS, REAL_GENERATION, build_random_model, checkpoint_bytes, preset_args

LARGE_BYTES = 2 * 1024**3
"""Checkpoints bigger than this need --allow-large (they take minutes and gigabytes to write)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles init-model",
        description="Write a randomly initialised HF checkpoint (config.json, safetensors, "
        "generation_config.json, tokenizer files) for a preset shape. No network.",
    )
    parser.add_argument(
        "--arch", default=None, help=f"{' | '.join(SUPPORTED_MODEL_TYPES)} (real presets imply it)"
    )
    parser.add_argument("--preset", required=True, help=" | ".join(PRESETS))
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default float32)")
    parser.add_argument(
        "--tokenizer", default=None, help="local tokenizer folder to ship instead of the default"
    )
    parser.add_argument(
        "--allow-large", action="store_true", help=f"allow checkpoints over {LARGE_BYTES >> 30} GiB"
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it already exists")
    return parser


def _generation_config(args: ModelArgs, tokenizer: Any) -> dict[str, Any]:
    eos = list(args.eos_token_ids)
    # Like Qwen's generation_config: stop at end of turn and at end of text.
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>") if tokenizer is not None else None
    if isinstance(end_of_text, int) and end_of_text != tokenizer.unk_token_id and end_of_text not in eos:
        eos.append(end_of_text)
    config: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if args.bos_token_id is not None:
        config["bos_token_id"] = args.bos_token_id
    if args.pad_token_id is not None:
        config["pad_token_id"] = args.pad_token_id
    return config


def _with_tokenizer_ids(args: ModelArgs, tokenizer: Any) -> ModelArgs:
    args.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else args.eos_token_id
    args.pad_token_id = tokenizer.pad_token_id
    args.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else args.bos_token_id
    return args


def _available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def init_model(
    out: str | Path,
    arch: str | None,
    preset: str,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    allow_large: bool = False,
    force: bool = False,
) -> tuple[Path, ModelArgs, str | None]:
    """Write the checkpoint; returns (folder, args, a note for the user or None)."""
    from transformers import GenerationConfig

    from miles.models.checkpoint import copy_tokenizer_files, resolve_dtype, save_pretrained
    from miles.models.tokenizer import char_tokenizer, load_tokenizer, save_char_tokenizer

    if dtype not in ("float32", "bfloat16"):
        raise MilesUserError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    out = Path(out).expanduser()
    if out.exists() and not force:
        raise MilesUserError(f"{out} already exists; pass --force to replace it")
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if preset == "tiny" and tokenizer is None:
        tokenizer = char_tokenizer()
    args = preset_args(arch, preset, vocab_size=len(tokenizer) if preset == "tiny" else None)
    if tokenizer is not None:
        if len(tokenizer) > args.vocab_size:
            raise MilesUserError(
                f"the tokenizer has {len(tokenizer)} tokens but preset {preset} has vocab_size {args.vocab_size}; "
                "pass the tokenizer this model family was trained with"
            )
        args = _with_tokenizer_ids(args, tokenizer)
    size = checkpoint_bytes(args, dtype)
    if size > LARGE_BYTES and not allow_large:
        raise MilesUserError(
            f"preset {preset} in {dtype} is a {size / 1e9:.1f} GB checkpoint; pass --allow-large to write it "
            "(GPU benchmarks can build it in memory instead: miles.models.presets.build_random_model)"
        )
    free = _available_memory_bytes()
    if free is not None and size > 0.9 * free:
        raise MilesUserError(
            f"preset {preset} in {dtype} needs ~{size / 1e9:.1f} GB of RAM to build and this machine has "
            f"{free / 1e9:.1f} GB free; use --dtype bfloat16 or a bigger machine"
        )
    model = build_random_model(args, dtype=resolve_dtype(dtype), device="cpu", seed=seed)
    with tempfile.TemporaryDirectory(prefix="miles-init-model-") as tmp:
        if tokenizer_dir is not None:
            copy_tokenizer_files(Path(tokenizer_dir).expanduser(), tmp)  # the user's files, verbatim
        elif tokenizer is not None:
            save_char_tokenizer(tmp)
        if not (Path(tmp) / "generation_config.json").exists():
            generation = (
                REAL_GENERATION.get(preset, {}) if tokenizer is None else _generation_config(args, tokenizer)
            )
            GenerationConfig(**generation).save_pretrained(tmp)
        save_pretrained(model, out, tokenizer_dir=tmp)
    note = None
    if tokenizer is None:
        note = (
            f"no tokenizer written: a {preset} tokenizer is not available offline. Copy its files "
            f"(tokenizer.json, tokenizer_config.json, ...) into {out}, or rerun with --tokenizer DIR"
        )
    return out, args, note


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse already printed usage or help
        return int(e.code or 0)
    try:
        out, args, note = init_model(
            opts.out,
            opts.arch,
            opts.preset,
            seed=opts.seed,
            dtype=opts.dtype,
            tokenizer_dir=opts.tokenizer,
            allow_large=opts.allow_large,
            force=opts.force,
        )
    except MilesUserError as e:
        print(f"miles init-model: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: {args.model_type} preset {opts.preset}, {args.num_parameters() / 1e6:.2f}M parameters, "
        f"{opts.dtype}, seed {opts.seed}"
    )
    if note:
        print(f"note: {note}")
    return 0
