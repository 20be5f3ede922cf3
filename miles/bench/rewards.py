"""`miles bench reward`: reward throughput (samples per second) on this machine, through RewardRunner.

Workloads: `math_numeric` (GSM8K-style "#### n" responses, the numeric fast path), `math_latex` (\\boxed{} LaTeX
that needs math-verify), `code` (a stdin/stdout program with 3 test cases per sample, each case in the sandbox).
Worker start-up is excluded (a warm-up batch runs first). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable

from miles.config import RewardConfig
from miles.sample import Sample

CODE_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def math_numeric_samples(count: int, rng: random.Random) -> list[Sample]:
    samples = []
    for _ in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        answer = a + b if rng.random() < 0.5 else a + b + 1
        samples.append(Sample(response_text=f"{a}+{b}={answer} #### {answer}", label=str(a + b)))
    return samples


def math_latex_samples(count: int, rng: random.Random) -> list[Sample]:
    samples = []
    for _ in range(count):
        p, q = rng.randint(1, 50), rng.randint(2, 50)
        k = rng.randint(2, 5)
        response = f"so the result is $\\boxed{{\\frac{{{p * k}}}{{{q * k}}}\\sqrt{{{k * k}}}}}$"
        samples.append(Sample(response_text=response, label=f"\\frac{{{p * k}}}{{{q}}}"))
    return samples


def code_samples(count: int, rng: random.Random) -> list[Sample]:
    samples = []
    for _ in range(count):
        pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(3)]
        label = {"inputs": [f"{a} {b}\n" for a, b in pairs], "outputs": [f"{a + b}\n" for a, b in pairs]}
        samples.append(Sample(response_text=CODE_PROGRAM, label=label))
    return samples


def measure(
    fn: str,
    make: Callable[[int, random.Random], list[Sample]],
    count: int,
    num_workers: int,
    timeout_s: float,
) -> dict[str, float]:
    from miles.rewards.runner import RewardRunner

    rng = random.Random(0)
    cfg = RewardConfig(fn=fn, num_workers=num_workers, timeout_s=timeout_s)
    with RewardRunner(cfg) as runner:
        runner.score(make(max(2, num_workers * 2), rng))  # warm-up: workers started, imports done
        samples = make(count, rng)
        start = time.perf_counter()
        metrics = runner.score(samples)
        seconds = time.perf_counter() - start
    return {
        "samples": count,
        "seconds": seconds,
        "samples_per_s": count / seconds,
        "mean_reward": metrics["reward/mean"],
        "errors": metrics["reward/errors"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles bench reward", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512, help="math samples per workload")
    parser.add_argument("--code-samples", type=int, default=32, help="code samples")
    parser.add_argument("--num-workers", type=int, default=RewardConfig.num_workers)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from miles.rewards.sandbox import sandbox_isolation

    rows = {
        "math_numeric": measure("math", math_numeric_samples, args.samples, args.num_workers, 10.0),
        "math_numeric_in_process": measure("math", math_numeric_samples, args.samples, 0, 10.0),
        "math_latex": measure("math", math_latex_samples, args.samples, args.num_workers, 10.0),
        "code": measure("code", code_samples, args.code_samples, args.num_workers, 30.0),
    }
    isolation = sandbox_isolation()
    print(f"{'workload':<24} {'samples':>8} {'seconds':>9} {'samples/s':>11} {'mean':>6} {'errors':>6}")
    for name, row in rows.items():
        print(
            f"{name:<24} {row['samples']:>8} {row['seconds']:>9.3f} {row['samples_per_s']:>11.1f} "
            f"{row['mean_reward']:>6.3f} {row['errors']:>6.0f}"
        )
    record = {
        "bench": "reward",
        "cpu_count": os.cpu_count(),
        "num_workers": args.num_workers,
        "sandbox": isolation.get("mode", "unavailable"),
        **{f"{name}_samples_per_s": round(row["samples_per_s"], 2) for name, row in rows.items()},
        **{f"{name}_errors": row["errors"] for name, row in rows.items()},
    }
    print(json.dumps(record))
    return 0
