"""`miles generate --model PATH --prompts FILE`: completions through the rollout engine, one JSON line each.

FILE is a .jsonl with a `prompt` field (text or chat messages) or a plain text file with one prompt a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles.config import DataConfig, RolloutConfig
from miles.data import check_prompt
from miles.data_files import read_jsonl
from miles.errors import MilesUserError


def read_prompts(path: Path) -> list[object]:
    """The prompts of a .jsonl (its `prompt` fields) or a text file (its non-blank lines). Errors name
    FILE:LINE (blank lines count) and what to do."""
    if not path.exists():
        raise MilesUserError(f"prompts file {path} does not exist")
    if path.suffix == ".jsonl":
        records = read_jsonl(path)  # bytes that are not UTF-8, a line that is no JSON object, an empty file
        prompts = []
        for i, record in enumerate(records.rows):
            if "prompt" not in record:
                raise MilesUserError(
                    f'{records.where(i)} is not a JSON object with a \'prompt\' field (e.g. {{"prompt": "2+2="}})'
                )
            check_prompt(record["prompt"], "prompt", records.where(i))
            prompts.append(record["prompt"])
        return prompts
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise MilesUserError(f"{path}:{line} is not UTF-8 text; save the file as UTF-8") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MilesUserError(f"{path} has no prompts (it is empty or blank): one prompt a line")
    return prompts


def sampling_temperature(n: int, temperature: float | None) -> float:
    """--temperature, or its default: 0 (greedy) for one sample, 1.0 for several (n greedy samples would be n
    copies of one answer)."""
    if temperature is not None:
        return temperature
    if n > 1:
        print(f"miles generate: -n {n} without --temperature: sampling at temperature 1.0", file=sys.stderr)
        return 1.0
    return 0.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles generate", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder, builtin:NAME or init:ARCH:PRESET")
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write JSON lines here instead of stdout")
    parser.add_argument("-n", type=int, default=1, help="samples per prompt")
    parser.add_argument(
        "--temperature", type=float, default=None, help="default: 0 (greedy) with -n 1, else 1.0"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    from miles.build import set_cpu_threads, stop_ids
    from miles.data import PromptFormatter
    from miles.model_io import load_model
    from miles.rollout import Engine, SamplingParams
    from miles.sample import Sample

    prompts = read_prompts(args.prompts)
    set_cpu_threads(1)
    loaded = load_model(args.model, args.dtype, args.device)
    formatter = PromptFormatter(loaded.tokenizer, DataConfig(), use_chat_template=not args.no_chat_template)
    requests = [Sample(prompt=p, prompt_ids=formatter.ids(p)) for p in prompts]
    engine = Engine(loaded.model, loaded.tokenizer, RolloutConfig())
    params = SamplingParams(
        n=args.n,
        temperature=sampling_temperature(args.n, args.temperature),
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop_token_ids=stop_ids(loaded.tokenizer, loaded.model.args.eos_token_ids),
    )
    out = args.out.open("w") if args.out else None
    for sample in engine.generate(requests, params):
        line = json.dumps(
            {
                "prompt": sample.prompt,
                "index": sample.index,
                "response": sample.response_text,
                "status": sample.status.value,
                "num_tokens": sample.response_length,
            }
        )
        print(line, file=out) if out else print(line)
    if out:
        out.close()
    return 0
