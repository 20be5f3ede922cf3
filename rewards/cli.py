"""`miles reward --fn NAME SAMPLES.jsonl`: score a jsonl file of samples offline, to test a reward before training.

Prints one JSON line per sample in input order ({"score": ..., the reward's extra fields, "error" when it failed}),
then one summary line ({"summary": {reward/* metrics, samples, seconds}}). Exit status 0 even when some samples
failed; 2 for bad input (missing file, unknown reward, bad JSON), with the reason on stderr.
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
    return Sample(prompt=row.get("prompt", ""), response_text=str(response), label=label, metadata=metadata)


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
