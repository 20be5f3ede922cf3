"""The CPU decode-attention kernel on and off in one process (docs/journal/2026-12-cpu-decode.md).

    OMP_NUM_THREADS=1 python docs/scripts/cpu_kernel_ab.py [INPUT_LEN OUTPUT_LEN [tiny|cpu-small [PAIRS]]]

The `tiny` bench workload (16 prompts x n = 8, or 8 prompts on `cpu-small`); the kernel is switched between
whole engine runs, the order swapped each pair, so that both see the same machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from miles.bench.rollout import _BENCH_PRESETS
from miles.config import RolloutConfig
from miles.models.args import ModelArgs
from miles.models.presets import build_random_model, preset_args
from miles.rollout.attention import cpu_kernel as cpu_attention
from miles.rollout.engine import Engine
from miles.rollout.sampling.params import SamplingParams


def main() -> None:
    input_len = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    output_len = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    preset = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    pairs = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    torch.set_num_threads(1)
    if preset == "cpu-small":
        args, num_prompts = ModelArgs(**_BENCH_PRESETS["cpu-small"]), 8
    else:
        args, num_prompts = preset_args("qwen3_moe", "tiny"), 16
        args.max_position_embeddings = max(args.max_position_embeddings, input_len + output_len)
    model = build_random_model(args, torch.float32, torch.device("cpu"), seed=0).eval()
    engine = Engine(model, None, RolloutConfig())
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (num_prompts, input_len), generator=gen).tolist()
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=output_len, ignore_eos=True, seed=0)
    engine.generate(prompts, params)
    times: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(pairs):
        for on in (True, False) if pair % 2 else (False, True):
            cpu_attention.kernel.on = on
            engine.flush_cache()
            start = time.perf_counter()
            engine.generate(prompts, params)
            times[on].append(time.perf_counter() - start)
    for on in (True, False):
        print(
            f"kernel {'on ' if on else 'off'}: min {min(times[on]):.3f} s, median {statistics.median(times[on]):.3f} s"
        )
    ratios = [off / on for off, on in zip(times[False], times[True], strict=True)]
    median_ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"off / on: ratio of medians {median_ratio:.3f}, median of pairs {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
