"""`miles <command>`: a thin dispatcher. Each command lives in its own module and is imported only when used,
so `miles --help` stays fast."""

from __future__ import annotations

import importlib
import sys

from miles.errors import MilesUserError

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("miles.commands.train:main", "run a recipe: miles train recipe=grpo_math [key=value ...]"),
    "generate": ("miles.commands.generate:main", "prompts file -> completions through the rollout engine"),
    "eval": ("miles.commands.eval:main", "greedy accuracy of a checkpoint on a held-out set"),
    "serve": ("miles.serve.cli:main", "the rollout engine behind an OpenAI-compatible API (127.0.0.1)"),
    "reward": ("miles.commands.reward:main", "score a jsonl of samples with any reward function"),
    "bench": ("", "benchmarks: miles bench rollout|reward|attention|layers|moe|train ..."),
    "init-model": ("miles.models.init_model:main", "write a random-initialised HF checkpoint + tokenizer"),
    "convert": (
        "miles.models.convert:main",
        "convert a GGUF model (e.g. SmolLM2) into an HF safetensors folder",
    ),
}
BENCHES: dict[str, str] = {
    "rollout": "miles.bench.rollout:main",
    "reward": "miles.bench.rewards:main",
    "attention": "miles.bench.attention:main",
    "layers": "miles.bench.layers:main",
    "moe": "miles.bench.moe:main",
    "train": "miles.bench.train:main",
    "sync": "miles.bench.sync:main",
}


def _call(target: str, argv: list[str]) -> int:
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(argv) or 0)


def usage() -> str:
    lines = ["usage: miles <command> [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`miles <command> --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "bench":
            if not rest or rest[0] not in BENCHES:
                print(f"usage: miles bench {{{'|'.join(BENCHES)}}} [args]", file=sys.stderr)
                return 0 if rest and rest[0] in ("-h", "--help") else 2
            return _call(BENCHES[rest[0]], rest[1:])
        if command not in COMMANDS:
            print(f"miles: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
            return 2
        return _call(COMMANDS[command][0], rest)
    except MilesUserError as e:
        print(f"miles {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
