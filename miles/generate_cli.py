"""`miles generate --model PATH --prompts FILE`: completions through the rollout engine, one JSON line each.

FILE is a .jsonl with a `prompt` field (text or chat messages) or a plain text file with one prompt a line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles.config import DataConfig, RolloutConfig
from miles.errors import MilesUserError


def read_prompts(path: Path) -> list[object]:
    if not path.exists():
        raise MilesUserError(f"prompts file {path} does not exist")
    # Numbered before blank lines are skipped, so an error's line number is the file's.
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MilesUserError(f"{path}:{number} is not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or "prompt" not in record:
                raise MilesUserError(
                    f'{path}:{number} is not a JSON object with a \'prompt\' field (e.g. {{"prompt": "2+2="}})'
                )
            prompts.append(record["prompt"])
        return prompts
    return [line for _, line in lines]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles generate", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder, builtin:NAME or init:ARCH:PRESET")
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write JSON lines here instead of stdout")
    parser.add_argument("-n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    from miles.data import PromptFormatter
    from miles.loop import set_cpu_threads, stop_ids
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
        temperature=args.temperature,
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
