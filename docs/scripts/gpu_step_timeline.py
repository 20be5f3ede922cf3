"""Where a GPU decode step's device idle time comes from (docs/benchmarks.md).

    python3 docs/scripts/gpu_step_timeline.py --model qwen3-8b --batch 256 [--trace DIR]

BATCH prompts of --input-len random tokens, --output-len new tokens each (`ignore_eos`, temperature 1),
`max_running_requests = BATCH`, page 16. Three parts, all in steady decode:

1. host time per engine part and per decode step (timers around the parts, no syncs added), and the step's
   wait for the device: a step that waits is device-bound;
2. `torch.profiler` over --profile-steps steps, the engine's parts marked with `record_function`;
3. every device gap of at least 20 µs in that window, with the launch of the kernel after it: launched
   after the gap began means the host was late (the part it was in is named); launched before means the
   device waited on something else (an event, a copy).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from miles.config import RolloutConfig
from miles.models.presets import build_random_model, preset_args
from miles.rollout import cuda_graph, scheduler
from miles.rollout import model_runner as runner_module
from miles.rollout.attention import flashinfer_backend as attention_flashinfer
from miles.rollout.engine import Engine
from miles.rollout.kv import manager as kv_manager
from miles.rollout.sampling.params import SamplingParams

PARTS = [
    (Engine, "step", "step"),
    (scheduler.Scheduler, "schedule", "schedule"),
    (Engine, "_launch", "launch"),
    (Engine, "_build_batch", "launch.build"),
    (kv_manager.KVManager, "alloc_extend", "build.alloc"),
    (runner_module.ModelRunner, "forward", "launch.forward"),
    (cuda_graph.CudaGraphRunner, "_fill_inputs", "forward.fill"),
    (attention_flashinfer.FlashinferBackend, "plan", "forward.plan"),
    (cuda_graph, "paged_kv_metadata", "forward.metadata"),
    (Engine, "_sample", "launch.sample"),
    (Engine, "_commit", "commit"),
    (Engine, "_resolve", "resolve"),
]
"""(owner, attribute, label): the engine parts timed and marked."""

host_ns: dict[str, int] = collections.defaultdict(int)
marking = False


def instrument(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            if marking:
                with record_function(f"miles:{label}"):
                    return inner(*args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            host_ns[label] += time.perf_counter_ns() - start

    setattr(owner, name, wrapper)


def gaps_with_causes(trace: dict[str, Any], min_gap_us: float = 20.0) -> list[dict[str, Any]]:
    """Device gaps of at least `min_gap_us`, each with the host side of the launch that ended it."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("miles:")]
    host_calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]

    def innermost_mark(ts: float) -> str:
        inside = [m for m in marks if m["ts"] <= ts <= m["ts"] + m["dur"]]
        return min(inside, key=lambda m: m["dur"])["name"][6:] if inside else "(between steps)"

    found = []
    reach = device[0]["ts"] + device[0]["dur"] if device else 0.0
    for e in device[1:]:
        if e["ts"] - reach >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            gap_start, gap_end = reach, e["ts"]
            blocking = [
                c
                for c in host_calls
                if c["ts"] < gap_end and c["ts"] + c["dur"] > gap_start and c["dur"] >= min_gap_us
            ]
            found.append(
                {
                    "gap_us": gap_end - gap_start,
                    "at_us": gap_start,
                    "next": e["name"][:70],
                    "launch": launch["name"] if launch else None,
                    "host_late": bool(launch and launch["ts"] + launch["dur"] > gap_start),
                    "launched_in": innermost_mark(launch["ts"]) if launch else None,
                    "long_host_calls": sorted({c["name"] for c in blocking}),
                }
            )
        reach = max(reach, e["ts"] + e["dur"])
    return found


def main() -> None:
    global marking
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--piecewise-min-batch", type=int, default=RolloutConfig.cuda_graph_piecewise_min_batch)
    p.add_argument("--timed-steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--trace", default=None, help="folder for the window's Chrome trace (gzip)")
    a = p.parse_args()
    for owner, name, label in PARTS:
        instrument(owner, name, label)

    args = preset_args(None, a.model)
    model = build_random_model(args, torch.bfloat16, torch.device("cuda"), seed=0).eval()
    cfg = RolloutConfig(
        page_size=a.page_size,
        max_running_requests=a.batch,
        max_batch_tokens=16384,
        cuda_graph_piecewise_min_batch=a.piecewise_min_batch,
    )
    engine = Engine(model, None, cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (a.batch, a.input_len), generator=gen).tolist()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.output_len, ignore_eos=True, seed=0)
    engine.generate(prompts[:8], params.with_(max_new_tokens=4))  # JIT, graph capture
    engine.flush_cache()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.stats.decode_steps < 20:  # past the prefill steps
        engine.step()

    host_ns.clear()
    s = engine.stats
    steps0, wait0, t0 = s.decode_steps, s.device_wait_s, time.perf_counter()
    for _ in range(a.timed_steps):
        engine.step()
    torch.cuda.synchronize()
    steps = s.decode_steps - steps0
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    report: dict[str, Any] = {
        "model": a.model,
        "batch": len(engine.scheduler.running),
        "wall_ms_per_step": wall_ms,
        "device_wait_ms_per_step": 1e3 * (s.device_wait_s - wait0) / steps,
        "host_ms_per_step": {k: v / steps / 1e6 for k, v in sorted(host_ns.items())},
    }

    marking = True
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profile_steps):
            engine.step()
        torch.cuda.synchronize()
    marking = False
    out = Path(a.trace or "/tmp/miles-timeline")
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    trace = json.loads((out / "trace.json").read_text())
    if a.trace:
        with gzip.open(out / "trace.json.gz", "wt") as f:
            json.dump(trace, f)
    (out / "trace.json").unlink()
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    window = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_kernel[e["name"][:90]].append(e["dur"])
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:15]
    # The first profiled step starts on an idle device (the sync above): its gaps are left out.
    gaps = gaps_with_causes(trace)
    first_step_end = min(m["ts"] + m["dur"] for m in trace["traceEvents"] if m.get("name") == "miles:step")
    gaps = [g for g in gaps if g["at_us"] > first_step_end]
    by_cause: dict[str, float] = collections.defaultdict(float)
    for g in gaps:
        cause = f"host late in {g['launched_in']}" if g["host_late"] else "launched early (device-side wait)"
        by_cause[cause] += g["gap_us"]
    n = a.profile_steps - 1
    report.update(
        profiled_window_ms_per_step=window / 1e3 / a.profile_steps,
        kernel_ms_per_step=sum(e["dur"] for e in kernels) / 1e3 / a.profile_steps,
        long_gaps_per_step=len(gaps) / n,
        long_gap_ms_per_step={k: v / 1e3 / n for k, v in sorted(by_cause.items(), key=lambda kv: -kv[1])},
        longest_gaps=sorted(gaps, key=lambda g: -g["gap_us"])[:12],
        top_kernels_us_per_step=[
            {"kernel": name, "us": sum(d) / a.profile_steps, "calls": len(d) / a.profile_steps}
            for name, d in top_kernels
        ],
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
