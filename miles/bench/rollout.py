"""`miles bench rollout`: engine throughput on random prompts, with the decode roofline and an HF baseline.

    miles bench rollout --model qwen3-8b --num-prompts 1024 --input-len 512 --output-len 512 --hf-baseline

A preset name builds random weights in place (no download); a path loads an HF checkpoint. Prints one JSON
line, then a short table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch

from miles.bench.common import decode_flops_per_token, decode_weight_bytes, measure_copy_bandwidth
from miles.bench.hf_baseline import HFBaseline
from miles.bench.profiling import (
    SHORT_GAP_US,
    StepProfiler,
    add_breakdown,
    decode_by_batch,
    host_profile_top,
    record_decode_steps,
)
from miles.config import RolloutConfig
from miles.models import CausalLM, ModelArgs, fused_moe
from miles.models.checkpoint import from_pretrained, resolve_dtype
from miles.models.presets import PRESETS, build_random_model, preset_args
from miles.rollout import Engine, SamplingParams
from miles.rollout.kv.pool import KVLayout

_BENCH_PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized but big enough that matmuls, not per-op overhead, dominate a step (the shipped `tiny` is
    # hidden 64 x 2 layers, where both engines mostly measure Python and dispatch overhead).
    "cpu-small": dict(
        model_type="qwen3",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="miles bench rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="tiny", help=f"checkpoint path or preset: {', '.join([*PRESETS, *_BENCH_PRESETS])}"
    )
    p.add_argument(
        "--arch", default="qwen3_moe", help="architecture of the tiny preset: qwen3 | qwen3_moe | llama"
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO group size)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--radix-cache", default="on", choices=["on", "off"])
    p.add_argument("--cuda-graph", default="on", choices=["on", "off"])
    p.add_argument(
        "--piecewise-min-batch",
        type=int,
        default=RolloutConfig.cuda_graph_piecewise_min_batch,
        help="decode batches of at least this size replay piecewise graphs with eager attention (0: never)",
    )
    p.add_argument("--flashinfer-kernel", default="fa2", choices=["fa2", "fa3"])
    p.add_argument(
        "--flashinfer-decode",
        default="auto",
        choices=["auto", "tensor-cores", "cuda-cores"],
        help="decode attention on tensor cores or CUDA cores (auto: tensor cores from 4 q heads per KV head)",
    )
    p.add_argument("--fused-kernels", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "draft", "head"])
    p.add_argument("--spec-draft-tokens", type=int, default=4)
    p.add_argument(
        "--spec-min-accept-length",
        type=float,
        default=0.0,
        help="decode plain while the drafts keep fewer tokens a step than this (rollout.spec_min_accept_length)",
    )
    p.add_argument("--spec-probe-every", type=int, default=16, help="rollout.spec_probe_every")
    p.add_argument(
        "--draft-model",
        default=None,
        help="--speculative draft: checkpoint path, preset (random weights of their own, so drafts are rarely "
        "accepted: the draft's cost alone) or `self` (the model drafts for itself: every draft right)",
    )
    p.add_argument(
        "--draft-head",
        default=None,
        help="--speculative head: a trained head's folder (default: a new head, whose drafts are rarely "
        "accepted: the head's cost alone)",
    )
    p.add_argument(
        "--overlap",
        default="auto",
        choices=["auto", "on", "off"],
        help="overlap scheduling (auto: on on CUDA)",
    )
    p.add_argument("--hf-baseline", action="store_true", help="also time transformers' generate")
    p.add_argument("--hf-num-prompts", type=int, default=None, help="prompts for the baseline (default: all)")
    p.add_argument("--hf-output-len", type=int, default=None, help="baseline output length (default: same)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="filtered sampling (with --top-k, --min-p)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=1024)
    p.add_argument("--kv-cache-fraction", type=float, default=0.85)
    p.add_argument("--kv-cache-bytes", type=int, default=256 * 1024**2, help="KV pool on CPU")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--kv-virtual-memory",
        default="auto",
        choices=["auto", "on", "off"],
        help="GPU: the KV pool at reserved CUDA virtual addresses (rollout.kv_virtual_memory)",
    )
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="time schedule / build / forward / sample per step (synchronises, so no overlap)",
    )
    p.add_argument("--peak-flops", type=float, default=790e12, help="matmul ceiling for the FLOP floor")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="torch.profiler over --profile-steps engine steps from step --profile-start: a Chrome trace in "
        "DIR and the kernels by device time in the JSON (profiling slows those steps)",
    )
    p.add_argument("--profile-start", type=int, default=300)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile the (last) timed run: the engine's host functions by cumulative time per step in the "
        "JSON (Python times inflated by the profiler, C++ calls such as kernel and graph launches not)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the engine (then the HF baseline) this many times and report the median wall times; the "
        "other numbers are the last engine run's (for noisy shared CPUs)",
    )
    p.add_argument(
        "--moe-configs",
        default=None,
        metavar="JSON",
        help="fused-MoE tile tables to use (`miles bench moe --sweep --save-configs` writes them)",
    )
    return p.parse_args(argv)


def is_preset(name: str) -> bool:
    return name in PRESETS or name in _BENCH_PRESETS


def bench_preset_args(name: str, arch: str) -> ModelArgs:
    """A shape preset's arguments (`--arch` picks the tiny preset's architecture)."""
    if name in _BENCH_PRESETS:
        return ModelArgs(**_BENCH_PRESETS[name])
    return preset_args(arch if name == "tiny" else None, name)


def bench_draft_model(
    a: argparse.Namespace, model: CausalLM, dtype: torch.dtype, device: torch.device
) -> CausalLM | None:
    if a.speculative != "draft":
        return None
    if not a.draft_model:
        raise SystemExit("miles bench rollout: --speculative draft needs --draft-model PATH|PRESET|self")
    if a.draft_model == "self":
        return model
    if is_preset(a.draft_model):
        args = bench_preset_args(a.draft_model, a.arch)
        args.vocab_size = model.args.vocab_size
        args.max_position_embeddings = model.args.max_position_embeddings
        return build_random_model(args, dtype, device, seed=a.seed + 1).eval()
    return from_pretrained(a.draft_model, dtype=dtype, device=device).eval()


def main(argv: list[str]) -> int:
    a = parse(argv)
    if a.repeat < 1 or (a.repeat > 1 and a.profile):
        raise SystemExit("miles bench rollout: --repeat must be >= 1, and 1 with --profile")
    if a.moe_configs:
        fused_moe.tables = fused_moe.load_tables(a.moe_configs)
    device = torch.device(
        "cuda"
        if a.device == "auto" and torch.cuda.is_available()
        else ("cpu" if a.device == "auto" else a.device)
    )
    on_gpu = device.type == "cuda"
    dtype = resolve_dtype(a.dtype or ("bfloat16" if on_gpu else "float32"))
    if is_preset(a.model):
        args = bench_preset_args(a.model, a.arch)
        args.max_position_embeddings = max(args.max_position_embeddings, a.input_len + a.output_len + 8)
        model = build_random_model(args, dtype, device, seed=a.seed).eval()
    else:
        model = from_pretrained(a.model, dtype=dtype, device=device).eval()
        args = model.args
    # The roofline's denominator is a ceiling: the copy bandwidth is measured before the run (cold) and after
    # it (hot) and the higher one is used. One measurement varied by 3 % between runs on one machine.
    copy_before = measure_copy_bandwidth(device) if on_gpu else None
    cfg = RolloutConfig(
        backend=a.backend,
        max_batch_tokens=a.max_batch_tokens,
        max_running_requests=min(a.max_running_requests, a.max_batch_tokens),
        kv_cache_bytes=a.kv_cache_bytes,
        kv_cache_fraction=a.kv_cache_fraction,
        page_size=a.page_size,
        kv_virtual_memory=a.kv_virtual_memory,
        radix_cache=a.radix_cache == "on",
        cuda_graph=a.cuda_graph == "on",
        cuda_graph_piecewise_min_batch=a.piecewise_min_batch,
        deterministic=a.deterministic,
        overlap_schedule=a.overlap,
        flashinfer_kernel=a.flashinfer_kernel,
        flashinfer_decode=a.flashinfer_decode,
        fused_kernels=a.fused_kernels,
        speculative=a.speculative,
        spec_draft_tokens=a.spec_draft_tokens,
        spec_min_accept_length=a.spec_min_accept_length,
        spec_probe_every=a.spec_probe_every,
        spec_head=a.draft_head,
        spec_draft_train=a.speculative == "head" and not a.draft_head,  # (only quiets the untrained warning)
    )
    engine = Engine(model, None, cfg, draft_model=bench_draft_model(a, model, dtype, device))
    gen = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(0, args.vocab_size, (a.num_prompts, a.input_len), generator=gen).tolist()
    params = SamplingParams(
        n=a.n,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        max_new_tokens=a.output_len,
        ignore_eos=True,
        seed=a.seed,
    )

    # Warm-up: kernel JIT / CUDA-graph capture, on other prompts, then an empty cache.
    warm = torch.randint(
        0, args.vocab_size, (min(8, a.num_prompts), min(a.input_len, 64)), generator=gen
    ).tolist()
    # With speculation the warm-up must run full drafts too (a verify graph, the draft model's own graphs
    # and kernels): a request drafts only spec_draft_tokens short of its end.
    warm_tokens = 4 + (a.spec_draft_tokens + 1 if a.speculative != "off" else 0)
    engine.generate(warm, params.with_(max_new_tokens=warm_tokens, n=1))
    breakdown: dict[str, float] = {}
    if a.breakdown:
        add_breakdown(engine, breakdown)
    decode_steps: list[tuple[int, int, float, float]] = []
    record_decode_steps(engine, decode_steps)
    profile_report: dict[str, Any] = {}
    profiler = StepProfiler(engine, a, profile_report) if a.profile else None
    walls: list[float] = []
    host_profile: cProfile.Profile | None = None
    # On CPU the baseline runs right after each engine run, so both sides of a ratio see the same machine
    # (shared cores drift by ~10 % within a minute); `speedup_vs_hf_paired` is the median ratio of the pairs,
    # `speedup_vs_hf_best` the ratio of the fastest runs (a neighbour's load only ever slows a run down).
    baseline: HFBaseline | None = None
    cpu_peak_bytes = 0
    for run in range(a.repeat):  # each run from an empty cache, its counters alone
        if a.host_profile and run == a.repeat - 1:
            host_profile = cProfile.Profile()
        engine.flush_cache()
        engine.metrics(reset=True)
        breakdown.clear()
        decode_steps.clear()
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        completed = False
        try:
            if host_profile is not None:
                host_profile.enable()
            samples = engine.generate(prompts, params)
            if on_gpu:
                torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - t0)
            completed = True
        finally:
            if host_profile is not None:
                host_profile.disable()
            if profiler is not None:
                profiler.finish(completed)
        if a.hf_baseline and not on_gpu:
            if baseline is None:
                # The engine's peak alone, before the baseline allocates anything.
                cpu_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                baseline = HFBaseline(model, prompts, a, device)
            baseline.run()
    wall = statistics.median(walls)
    stats = engine.stats
    out_tokens = sum(len(s.response_ids) for s in samples)
    result: dict[str, Any] = {
        "model": a.model,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "backend": engine.backend,
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "n": a.n,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "top_k": a.top_k,
        "min_p": a.min_p,
        "radix_cache": a.radix_cache,
        "cuda_graph": a.cuda_graph == "on" and on_gpu,
        "piecewise_min_batch": a.piecewise_min_batch if engine.runner.graphs is not None else None,
        "overlap_schedule": engine.overlap,
        "fused_kernels": engine.runner.fused_kernels,
        "page_size": a.page_size,
        "flashinfer_kernel": a.flashinfer_kernel if engine.backend == "flashinfer" else None,
        "flashinfer_decode": (
            ("tensor-cores" if engine.runner.flashinfer.decode_tensor_cores else "cuda-cores")
            if engine.runner.flashinfer is not None
            else None
        ),
        "moe_configs": a.moe_configs,
        "wall_s": wall,
        "wall_s_runs": walls,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + a.num_prompts * a.n * a.input_len) / wall,
        "prefill_tokens": stats.prefill_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "prefix_hit_rate": stats.cached_prompt_tokens / max(stats.prompt_tokens, 1),
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_steps": stats.decode_steps,
        "device_wait_s": stats.device_wait_s,
        # Pure decode steps only: the decode rows of steps that also prefill are timed with the prefill.
        "decode_tokens_per_s": stats.decode_step_tokens / stats.decode_s if stats.decode_s else 0.0,
        "preemptions": stats.preemptions,
        "dropped_rows": stats.dropped_rows,
        "speculative": a.speculative,
        "spec_draft_tokens": a.spec_draft_tokens if a.speculative != "off" else 0,
        "spec_accept_length": 1 + stats.spec_accepted_tokens / stats.spec_steps if stats.spec_steps else 0.0,
        "spec_draft_s": stats.spec_draft_s,
        "spec_chained_drafts": stats.spec_chained_drafts,
        "spec_gated_steps": stats.spec_gated_steps,
        "draft_model": a.draft_model if a.speculative == "draft" else None,
        "draft_head": (a.draft_head or "new") if a.speculative == "head" else None,
        "kv_pool_tokens": engine.pool.capacity_tokens,
        "kv_virtual_memory": engine.pool.keeps_addresses,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) + engine.pool.bytes_outside_allocator
        if on_gpu
        else cpu_peak_bytes or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if on_gpu and stats.decode_steps:
        assert copy_before is not None
        copy_after = copy_before
        if engine.pool.allocated:
            try:
                copy_after = measure_copy_bandwidth(device)
            except torch.cuda.OutOfMemoryError:
                print(
                    "no memory left to measure the copy bandwidth after the run; using the one before",
                    file=sys.stderr,
                )
        bandwidth = max(copy_before, copy_after)
        decoded = stats.decode_step_tokens
        avg_batch = decoded / stats.decode_steps
        kv_bytes = KVLayout.for_model(args, dtype, 1).bytes_per_token
        context = stats.decode_kv_tokens / max(decoded, 1)
        weight_s = stats.decode_steps * decode_weight_bytes(args, dtype, avg_batch) / bandwidth
        kv_s = stats.decode_kv_tokens * kv_bytes / bandwidth
        gemm_flop_s = decoded * decode_flops_per_token(args, 0.0) / a.peak_flops
        flop_s = decoded * decode_flops_per_token(args, context) / a.peak_flops
        floor_s = weight_s + kv_s
        # Layer by layer the GEMMs (compute-bound at large batch) and the attention (bandwidth-bound) run one
        # after the other, so each is floored by its own bytes or FLOPs, whichever takes longer.
        serial_s = max(weight_s, gemm_flop_s) + max(kv_s, flop_s - gemm_flop_s)
        decode_rate = result["decode_tokens_per_s"]
        result.update(
            serial_floor_output_tokens_per_s=decoded / serial_s,
            decode_pct_of_serial_floor=100 * decode_rate * serial_s / decoded,
            copy_bandwidth_bytes_per_s=bandwidth,
            copy_bandwidth_before_after=[copy_before, copy_after],
            avg_decode_batch=avg_batch,
            avg_decode_context=context,
            roofline_output_tokens_per_s=decoded / floor_s,
            decode_pct_of_roofline=100 * decode_rate * floor_s / decoded,
            flop_floor_output_tokens_per_s=decoded / flop_s,
            decode_pct_of_bytes_or_flops_floor=100 * decode_rate * max(floor_s, flop_s) / decoded,
            decode_by_batch=decode_by_batch(decode_steps, args, dtype, bandwidth),
        )
    if breakdown:
        result["breakdown_s"] = breakdown
    if host_profile is not None:
        result["host_profile_top"] = host_profile_top(host_profile, max(stats.steps, 1))
    result.update(profile_report)
    if a.hf_baseline:
        if baseline is None:  # on the GPU after the engine, whose KV pool would leave it no memory
            engine.release_memory()
            baseline = HFBaseline(model, prompts, a, device)
            for _ in range(a.repeat):
                baseline.run()
        result.update(baseline.result())
        result["speedup_vs_hf"] = result["output_tokens_per_s"] / result["hf_output_tokens_per_s"]
        if not on_gpu:  # only there is each baseline run next to its engine run
            result["speedup_vs_hf_paired"] = statistics.median(
                hf / ours for hf, ours in zip(baseline.walls, walls)
            )
            result["speedup_vs_hf_best"] = min(baseline.walls) / min(walls)
    print(json.dumps(result), flush=True)
    print_table(result)
    return 0


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("model", r["model"]),
        ("device / dtype / backend", f"{r['device']} / {r['dtype']} / {r['backend']}"),
        ("prompts x n x (in, out)", f"{r['num_prompts']} x {r['n']} x ({r['input_len']}, {r['output_len']})"),
        ("output tok/s", f"{r['output_tokens_per_s']:,.0f}"),
        ("total tok/s", f"{r['total_tokens_per_s']:,.0f}"),
        ("prefill tokens computed / cached", f"{r['prefill_tokens']:,} / {r['cached_prompt_tokens']:,}"),
        ("prefill s / decode s", f"{r['prefill_s']:.2f} / {r['decode_s']:.2f}"),
        ("host waited for the device (s)", f"{r['device_wait_s']:.2f}"),
        ("decode tok/s", f"{r['decode_tokens_per_s']:,.0f}"),
    ]
    if "roofline_output_tokens_per_s" in r:
        rows.append(
            (
                "decode roofline tok/s (% reached)",
                f"{r['roofline_output_tokens_per_s']:,.0f} ({r['decode_pct_of_roofline']:.1f}%)",
            )
        )
        before, after = r["copy_bandwidth_before_after"]
        rows.append(("copy TB/s before / after (roofline uses)", f"{before / 1e12:.2f} / {after / 1e12:.2f}"))
    if "flop_floor_output_tokens_per_s" in r:
        rows.append(
            (
                "decode FLOP floor tok/s (% of max floor)",
                f"{r['flop_floor_output_tokens_per_s']:,.0f} ({r['decode_pct_of_bytes_or_flops_floor']:.0f}%)",
            )
        )
    if "serial_floor_output_tokens_per_s" in r:
        rows.append(
            (
                "decode serial floor tok/s (% reached)",
                f"{r['serial_floor_output_tokens_per_s']:,.0f} ({r['decode_pct_of_serial_floor']:.0f}%)",
            )
        )
    for b in r.get("decode_by_batch", []):
        rows.append(
            (
                f"  decode steps at batch ~{b['avg_batch']:.0f}",
                f"{b['steps']} x {b['ms_per_step']:.2f} ms (host {b['host_ms_per_step']:.2f}), "
                f"context {b['avg_context']:.0f}, "
                f"roofline {b['roofline_ms_per_step']:.2f} ms ({b['pct_of_roofline']:.0f}%)",
            )
        )
    if "breakdown_s" in r:
        rows.append(("step breakdown s", ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_s"].items())))
    if len(r["wall_s_runs"]) > 1:
        runs = ", ".join(f"{w:.3f}" for w in r["wall_s_runs"])
        rows.append((f"engine wall s, median of {len(r['wall_s_runs'])}", f"{r['wall_s']:.3f} ({runs})"))
        if "hf_wall_s_runs" in r:
            runs = ", ".join(f"{w:.3f}" for w in r["hf_wall_s_runs"])
            rows.append(("HF wall s, median", f"{r['hf_wall_s']:.3f} ({runs})"))
    if "hf_output_tokens_per_s" in r:
        rows.append(
            (
                "HF generate tok/s (prompts, out)",
                f"{r['hf_output_tokens_per_s']:,.0f} ({r['hf_num_prompts']}, {r['hf_output_len']})",
            )
        )
        rows.append(("speedup vs HF (ratio of medians)", f"{r['speedup_vs_hf']:.2f}x"))
        if "speedup_vs_hf_paired" in r:
            rows.append(("speedup vs HF (median of run pairs)", f"{r['speedup_vs_hf_paired']:.2f}x"))
            rows.append(("speedup vs HF (fastest runs)", f"{r['speedup_vs_hf_best']:.2f}x"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if "profile_top" in r:
        print(
            f"profiled: {r['profile_ms_per_step']:.2f} ms of kernels per step of {r['profile_wall_ms_per_step']:.2f} "
            "ms (profiler on)"
            + (
                f", device busy {100 * r['profile_device_busy_fraction']:.0f}% of the window; idle per step "
                f"{r['profile_short_gap_ms_per_step']:.2f} ms in {r['profile_short_gaps_per_step']:.0f} gaps "
                f"< {SHORT_GAP_US:.0f} us, {r['profile_long_gap_ms_per_step']:.2f} ms in longer ones"
                if "profile_device_busy_fraction" in r
                else ""
            )
        )
        for e in r["profile_top"]:
            print(f"  {e['ms_per_step']:8.3f} ms  x{e['calls_per_step']:<6.1f} {e['name'][:90]}")
        for g in r.get("profile_longest_gaps", []):
            print(f"  idle {g['ms']:.3f} ms after {g['after'][:50]} before {g['before'][:50]}")
    if "host_profile_top" in r:
        print("host (cProfile), ms per step: cumulative, own, calls")
        for e in r["host_profile_top"]:
            print(
                f"  {e['cum_ms_per_step']:8.3f} {e['self_ms_per_step']:8.3f} x{e['calls_per_step']:<7.1f} "
                f"{e['function'][:90]}"
            )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
