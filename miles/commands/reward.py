"""`miles reward --fn NAME SAMPLES.jsonl`: score a jsonl file of samples offline, to test a reward before training.

Prints one JSON line per sample in input order ({"score": ..., the reward's extra fields, "error" when it failed}),
then one summary line ({"summary": {reward/* metrics, samples, seconds}}). Exit status 0 even when some samples
failed; 2 for bad input (missing file, unknown reward, bad JSON), with the reason on stderr.

Token ids: `sample.response_ids` / `prompt_ids` come from the rows' `response_ids` / `prompt_ids` fields; rows
without them (a training run's samples.jsonl holds texts only) are tokenized with `--tokenizer` when given. Otherwise
the ids stay empty, which a length-based reward would misread, so a warning on stderr says how many rows lack them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from miles.config import RewardConfig
from miles.errors import MilesUserError
from miles.sample import Sample


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles reward",
        description="Score a jsonl file of samples with a reward: one JSON line per sample, then a summary line.",
    )
    parser.add_argument(
        "samples",
        help="jsonl file: one object per line with response, label and optionally "
        "prompt, data_source, metadata, extra_info",
    )
    parser.add_argument(
        "--fn",
        required=True,
        help="built-in (math, exact_match, format, code, judge, remote), "
        "pkg.module:function or path/to/file.py:function",
    )
    parser.add_argument("--timeout-s", type=float, default=RewardConfig.timeout_s, help="per-call timeout")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--batched", action="store_true", help="the function takes the list of samples")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or builtin:NAME whose tokenizer fills response_ids / prompt_ids for rows without them "
        "(length-based rewards read sample.response_ids)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=RewardConfig.num_workers,
        help="reward worker processes (0: score in this process)",
    )
    return parser


def sample_from_row(row: Any, line_number: int) -> Sample:
    if not isinstance(row, dict):
        raise MilesUserError(f"line {line_number}: expected a JSON object, got {type(row).__name__}")
    response = row.get("response", row.get("response_text"))
    if response is None:
        raise MilesUserError(f"line {line_number}: no 'response' field (fields: {sorted(row)})")
    label = row.get("label")
    if label is None and isinstance(row.get("reward_model"), dict):
        label = row["reward_model"].get("ground_truth")  # verl's schema
    metadata = dict(row.get("metadata") or {})
    for key in ("data_source", "extra_info"):
        if key in row:
            metadata.setdefault(key, row[key])
    return Sample(
        prompt=row.get("prompt", ""),
        response_text=str(response),
        label=label,
        metadata=metadata,
        prompt_ids=_token_ids(row, "prompt_ids", line_number),
        response_ids=_token_ids(row, "response_ids", line_number),
    )


def _token_ids(row: dict[str, Any], key: str, line_number: int) -> list[int]:
    ids = row.get(key)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MilesUserError(f"line {line_number}: {key!r} must be a list of token ids (integers)")
    return ids


def _load_tokenizer(spec: str) -> Any:
    from miles.model_io import resolve_path

    folder = Path(spec) if Path(spec).is_dir() else resolve_path(spec)
    if folder is None:  # init:ARCH:PRESET models use the character tokenizer
        from miles.models.tokenizer import char_tokenizer

        return char_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise MilesUserError(f"--tokenizer {spec}: no usable tokenizer files there ({e})") from e


def fill_token_ids(samples: list[Sample], tokenizer_spec: str | None) -> None:
    """Tokenizes the rows that came without ids (with --tokenizer), else warns that their ids are empty."""
    missing = [s for s in samples if not s.response_ids and s.response_text]
    if not missing:
        return
    if tokenizer_spec is None:
        print(
            f"miles reward: warning: {len(missing)} of {len(samples)} samples have no response_ids (no "
            "'response_ids' field): rewards that read sample.response_ids / response_length see 0 tokens. Pass "
            "--tokenizer MODEL_DIR (or builtin:NAME) to tokenize them, or add the ids to the rows",
            file=sys.stderr,
        )
        return
    tokenizer = _load_tokenizer(tokenizer_spec)
    for sample in missing:
        sample.response_ids = list(tokenizer(sample.response_text, add_special_tokens=False)["input_ids"])
        if not sample.prompt_ids and isinstance(sample.prompt, str) and sample.prompt:
            sample.prompt_ids = list(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])


def load_samples(path: str) -> list[Sample]:
    file = Path(path)
    if not file.is_file():
        raise MilesUserError(f"samples file {path} does not exist")
    samples = []
    with file.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MilesUserError(f"{path} line {line_number} is not valid JSON: {e}") from e
            samples.append(sample_from_row(row, line_number))
    return samples


def _parse_kwargs(text: str) -> dict[str, Any]:
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise MilesUserError(
            f"--kwargs is not valid JSON ({e}); e.g. --kwargs '{{\"case_sensitive\": true}}'"
        ) from e
    if not isinstance(kwargs, dict):
        raise MilesUserError(f"--kwargs must be a JSON object, got {type(kwargs).__name__}")
    return kwargs


def run(args: argparse.Namespace) -> int:
    from miles.rewards.runner import RewardRunner

    cfg = RewardConfig(
        fn=args.fn,
        kwargs=_parse_kwargs(args.kwargs),
        batched=args.batched,
        timeout_s=args.timeout_s,
        num_workers=args.num_workers,
    )
    samples = load_samples(args.samples)
    fill_token_ids(samples, args.tokenizer)
    start = time.perf_counter()
    with RewardRunner(cfg) as runner:
        metrics = runner.score(samples)
    seconds = time.perf_counter() - start
    for sample in samples:
        print(json.dumps({"score": sample.reward, **sample.reward_info}, default=str))
    print(json.dumps({"summary": {"samples": len(samples), "seconds": round(seconds, 4), **metrics}}))
    return 0


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed usage / help
        return int(e.code or 0)
    # Reward failures (the first traceback of each kind) go to stderr; stdout stays one JSON object per line.
    logger = logging.getLogger("miles.rewards")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate, logger.level = False, logging.WARNING
    try:
        return run(args)
    except MilesUserError as e:
        print(f"miles reward: error: {e}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(handler)
        logger.propagate, logger.level = saved
