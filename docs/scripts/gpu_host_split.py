"""Host time per decode step of `qwen3-0.6b` on the GPU, by engine part (docs/benchmarks.md, "Small models").

    python3 docs/scripts/gpu_host_split.py BATCH [graph|eager]

`eager` keeps the sampler out of its CUDA graphs. Each part is wrapped with a timer (no syncs added); the
numbers are the best of 3 generates, per decode step.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import torch

from miles.config import RolloutConfig
from miles.models.presets import build_random_model, preset_args
from miles.rollout import cuda_graph, scheduler
from miles.rollout import model_runner as runner_module
from miles.rollout.attention import flashinfer_backend as attention_flashinfer
from miles.rollout.engine import Engine
from miles.rollout.kv import manager as kv_manager
from miles.rollout.sampling import graph as sampler_graph
from miles.rollout.sampling.params import SamplingParams

per_step: dict[str, int] = collections.defaultdict(int)
captures: dict[str, int] = collections.defaultdict(int)


def timed(owner: Any, name: str, label: str, into: dict[str, int]) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            into[label] += time.perf_counter_ns() - start

    setattr(owner, name, wrapper)


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    variant = sys.argv[2] if len(sys.argv) > 2 else "graph"
    if variant == "eager":
        cuda_graph.CudaGraphRunner.sample = lambda self, logits, st: None  # type: ignore[method-assign]
    for owner, name, label in [
        (Engine, "step", "step"),
        (scheduler.Scheduler, "schedule", "schedule"),
        (Engine, "_launch", "launch"),
        (Engine, "_build_batch", "launch.build"),
        (kv_manager.KVManager, "alloc_extend", "build.kv_alloc"),
        (runner_module.ModelRunner, "forward", "launch.forward"),
        (cuda_graph.CudaGraphRunner, "_fill_inputs", "forward.fill"),
        (attention_flashinfer.FlashinferBackend, "plan", "forward.plan"),
        (cuda_graph, "paged_kv_metadata", "forward.metadata"),
        (torch.cuda.CUDAGraph, "replay", "forward.graph_replay"),
        (Engine, "_sample", "launch.sample"),
        (Engine, "_sample_rows", "sample.rows"),
        (Engine, "_commit", "commit"),
        (Engine, "_resolve", "resolve"),
    ]:
        timed(owner, name, label, per_step)
    timed(cuda_graph.CudaGraphRunner, "capture", "capture_all_ms", captures)
    timed(sampler_graph.SamplerGraphs, "capture", "sampler_captures_ms", captures)

    args = preset_args(None, "qwen3-0.6b")
    model = build_random_model(args, torch.bfloat16, torch.device("cuda"), seed=0).eval()
    cfg = RolloutConfig(page_size=16, max_running_requests=1024, max_batch_tokens=16384)
    engine = Engine(model, None, cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (batch, 128), generator=gen).tolist()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=0)
    engine.generate(prompts[:8], params.with_(max_new_tokens=4))
    engine.flush_cache()
    engine.generate(prompts, params)
    best: dict[str, float] | None = None
    for _ in range(3):
        engine.flush_cache()
        for prompt in prompts:
            engine.add_request(prompt, params)
        engine.step()
        engine.step()
        per_step.clear()
        steps, waited = 0, engine.stats.device_wait_s
        while engine.has_unfinished:
            engine.step()
            steps += 1
        parts = {k: v / steps / 1e3 for k, v in per_step.items()}
        parts["device_wait"] = (engine.stats.device_wait_s - waited) / steps * 1e6
        if best is None or parts["step"] < best["step"]:
            best = parts
    assert best is not None
    print(f"batch {batch}, sampler {variant}, µs per decode step (best of 3 generates):")
    for key in sorted(best):
        print(f"  {key:<22} {best[key]:7.0f}")
    print("  captures (ms, first call):", {k: round(v / 1e6) for k, v in captures.items()})


if __name__ == "__main__":
    main()
