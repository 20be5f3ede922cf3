"""`miles eval --model PATH`: greedy accuracy of any checkpoint on a held-out set (JSON on stdout)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from miles.config import DataConfig, RewardConfig, RolloutConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles eval", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder, builtin:NAME or init:ARCH:PRESET")
    parser.add_argument(
        "--data",
        default=None,
        help="jsonl / parquet / saved dataset folder (a DatasetDict: its test split, else validation; DIR:split "
        "picks one). Default: the synthetic math test split",
    )
    parser.add_argument(
        "--source",
        default=None,
        help="a data source instead of --data: synthetic_math or reasoning_gym:<task> (its held-out split, "
        "judged by its own verifier unless --reward is given)",
    )
    parser.add_argument(
        "--task-config",
        default="{}",
        help="with --source reasoning_gym:<task>: its generator settings as JSON, e.g. '{\"min_terms\": 3}'",
    )
    parser.add_argument("--num", type=int, default=200, help="number of held-out problems")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--reward", default=None, help="reward used to judge correctness (score > 0.5); default: math"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument(
        "--fewshot",
        default="[]",
        help="worked examples shown before each prompt, as a recipe's data.fewshot: JSON, e.g. "
        '\'[{"user": "2 + 3 + 1 =", "assistant": "2 + 3 = 5\\n5 + 1 = 6\\n#### 6"}]\'',
    )
    args = parser.parse_args(argv)
    if args.data and args.source:
        parser.error("give --data FILE or --source NAME, not both")
    reward = args.reward or ("reasoning_gym" if (args.source or "").startswith("reasoning_gym:") else "math")

    from miles.build import set_cpu_threads, stop_ids
    from miles.data import PromptFormatter, fewshot_turns, load_eval_rows, to_samples
    from miles.errors import MilesUserError
    from miles.evaluate import evaluate
    from miles.model_io import load_model
    from miles.rewards import RewardRunner
    from miles.rollout import Engine

    task_config = _json_arg(parser, "--task-config", args.task_config, dict, '{"min_terms": 3}')
    fewshot = _json_arg(parser, "--fewshot", args.fewshot, list, '[{"user": "...", "assistant": "..."}]')
    try:
        fewshot_turns(fewshot)
    except MilesUserError as e:
        parser.error(f"--fewshot: {e}")
    data_cfg = DataConfig(
        test_size=args.num,
        train_size=0,
        system_prompt=args.system_prompt,
        task_config=task_config,
        fewshot=fewshot,
    )
    if args.source:
        data_cfg.source = args.source
    if args.data:
        data_cfg.source, data_cfg.path, data_cfg.eval_path = "file", args.data, args.data
    set_cpu_threads(1)
    loaded = load_model(args.model, args.dtype, args.device)
    formatter = PromptFormatter(loaded.tokenizer, data_cfg)
    test_rows = load_eval_rows(data_cfg)
    prompts, dropped = to_samples(test_rows[: args.num], formatter, data_cfg.max_prompt_length)
    engine = Engine(loaded.model, loaded.tokenizer, RolloutConfig())
    with RewardRunner(RewardConfig(fn=reward, num_workers=0), engine=engine) as rewards:
        eos = stop_ids(loaded.tokenizer, loaded.model.args.eos_token_ids)
        metrics, _ = evaluate(engine.generate, rewards, prompts, args.max_new_tokens, eos, [])
    metrics["eval/dropped_prompts"] = float(dropped)
    print(json.dumps({"model": args.model, **metrics}))
    return 0


def _json_arg(parser: argparse.ArgumentParser, flag: str, text: str, kind: type, example: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        parser.error(f"{flag} is not JSON ({e}); write it as '{example}'")
    if not isinstance(value, kind):
        parser.error(f"{flag} must be a JSON {'object' if kind is dict else 'list'}, e.g. '{example}'")
    return value
