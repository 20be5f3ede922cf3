"""`miles bench train`: one RL update (`PolicyTrainer.train_step`) on random weights, per trainer backend.

A preset (or a checkpoint folder) is built in place; `--samples` sequences of `--prompt-len` + `--response-len`
random tokens with random advantages are trained on, `--steps` times after one warm-up step, with each
backend in turn on the same weights and samples. Reported per backend: seconds per update, trained tokens/s,
model FLOP utilisation (`train/mfu`, trainer/mfu.py: forward FLOPs x 3 for the backward, over the device's
bf16 peak), peak device memory (the bench's own copy of the starting weights included), and the first
update's loss and gradient norm (the backends must agree on those).
`--layers N` keeps only the first N layers of the preset (a 30B-A3B shape in a fraction of its memory).
`--profile N` then profiles one more update: its kernels' time by kind of work (GEMM, attention, copies,
optimizer, ...), its N costliest kernels and the N costliest operators with their input shapes and callers
(miles/bench/update_profile.py; on CPU the operators' own time).
`--backend deepspeed` trains under a DeepSpeed ZeRO engine (`--zero-stage`, `--offload-optimizer cpu`,
`--offload-param cpu`); a backend that runs out of device memory is reported as such (with the memory it
reached), and the process's peak host memory is reported too (the offloaded optimizer lives there).
`--nproc N` starts N ranks (one GPU each, or CPU processes over gloo with `--device cpu`; or run it under
torchrun), each training its share of the samples, the megatron backend split by `--tensor-parallel-size`,
`--expert-parallel-size` and `--expert-tensor-parallel-size` (miles/bench/train_ranks.py); the figures are
then the whole run's, peak memory the largest rank's (each rank's in the JSON).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from miles.bench.train_ranks import (
    as_flags,
    check_sizes,
    hide_gpus_from_cpu_ranks,
    largest_over_ranks,
    launch_ranks,
    rank_entry,
)
from miles.bench.update_profile import print_profile, profile_update
from miles.config import AlgorithmConfig, TrainerConfig
from miles.distributed import SINGLE, DataParallel, init_data_parallel, needs_launch, shutdown
from miles.errors import MilesUserError
from miles.model_io import pick_device
from miles.models import CausalLM, ModelArgs
from miles.models.presets import PRESETS, build_random_model, preset_args
from miles.sample import Sample
from miles.trainer.backends import BACKENDS, build_policy
from miles.trainer.policy_trainer import PolicyTrainer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench train", description=__doc__)
    p.add_argument(
        "--model", default="qwen3-0.6b", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint folder"
    )
    p.add_argument("--arch", default=None, help="with --model tiny: qwen3 | qwen3_moe | llama")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--backend", default="torch,megatron", help="comma-separated: torch, megatron, deepspeed")
    p.add_argument("--zero-stage", type=int, default=3, help="deepspeed: ZeRO stage 1 | 2 | 3")
    p.add_argument("--offload-optimizer", default="none", help="deepspeed: none | cpu")
    p.add_argument("--offload-param", default="none", help="deepspeed, stage 3: none | cpu")
    p.add_argument(
        "--deepspeed-extra",
        default="{}",
        help='deepspeed: JSON merged over its config, e.g. \'{"zero_optimization": {"sub_group_size": 1e8}}\'',
    )
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--precision", default="bf16", help="fp32 | bf16 (autocast; bf16 weights compute in bf16 either way)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="the weights' dtype: float32 | bfloat16 (bf16 weights, as the engine runs them, with float32 "
        "master weights in the optimizer; --no-master-weights updates them in place)",
    )
    p.add_argument("--no-master-weights", action="store_true")
    p.add_argument(
        "--recompute",
        default="none",
        help="torch / megatron: activation recomputation none | selective | full",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="torch / megatron: masters and moments sharded over the data-parallel ranks (one rank here)",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks to start (one GPU each; CPU: gloo)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="megatron: ranks splitting a replica")
    p.add_argument(
        "--expert-parallel-size", type=int, default=1, help="megatron: ranks splitting the experts"
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="megatron: ranks splitting each expert (default: --tensor-parallel-size)",
    )
    p.add_argument("--report-to", default=None, help=argparse.SUPPRESS)  # a launched rank 0's report file
    p.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up update")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one more update per backend: time by kind of work, its N costliest "
        "kernels (CUDA) and operators with input shapes and callers",
    )
    return p.parse_args(argv)


def model_args(a: argparse.Namespace) -> ModelArgs:
    """The shape `build_model` builds (a preset cut to `--layers`, or a checkpoint's config.json)."""
    if a.model in PRESETS:
        args = preset_args(a.arch, a.model)
        if a.layers:
            args = replace(args, num_hidden_layers=min(a.layers, args.num_hidden_layers))
        return args
    return ModelArgs.from_json(Path(a.model) / "config.json")


def build_model(a: argparse.Namespace, device: torch.device) -> CausalLM:
    if a.model in PRESETS:
        return build_random_model(model_args(a), a.dtype, device, seed=a.seed)
    from miles.models import from_pretrained

    return from_pretrained(a.model, dtype=a.dtype).to(device)


def random_samples(a: argparse.Namespace, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(a.seed + 1)
    return [
        Sample(
            prompt_ids=torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab, (a.response_len,), generator=g).tolist(),
            rollout_logprobs=(-3 * torch.rand(a.response_len, generator=g)).tolist(),
            advantage=float(torch.randn((), generator=g)),
            group_id=i // 8,
            index=i % 8,
        )
        for i in range(a.samples)
    ]


def bench_backend(
    backend: str,
    model: CausalLM,
    samples: list[Sample],
    a: argparse.Namespace,
    dp: DataParallel = SINGLE,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """One backend's figures; with several ranks `samples` is this rank's share of `batch_size`."""
    cfg = TrainerConfig(
        backend=backend,
        global_batch_size=batch_size or len(samples),
        micro_batch_tokens=a.micro_batch_tokens,
        precision=a.precision,
        master_weights=not a.no_master_weights,
        lr=1e-6,
        zero_stage=a.zero_stage,
        offload_optimizer=a.offload_optimizer,
        offload_param=a.offload_param,
        deepspeed_extra=json.loads(a.deepspeed_extra),
        recompute=a.recompute if backend != "deepspeed" else "none",
        distributed_optimizer=a.distributed_optimizer and backend != "deepspeed",
    )
    on_cuda = model.device.type == "cuda"
    try:
        return _bench(backend, cfg, model, samples, a, on_cuda, dp)
    except torch.cuda.OutOfMemoryError as err:
        if dp.enabled:
            raise  # the other ranks wait in a collective: the launcher stops them all
        peak = torch.cuda.max_memory_allocated() if on_cuda else None
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
        return {
            "backend": backend,
            "error": f"CUDA out of memory: {str(err)[:200]}",
            "peak_memory_bytes": peak,
        }


def _bench(
    backend: str,
    cfg: TrainerConfig,
    model: CausalLM,
    samples: list[Sample],
    a: argparse.Namespace,
    on_cuda: bool,
    dp: DataParallel = SINGLE,
) -> dict[str, Any]:
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    policy = build_policy(
        backend,
        model,
        precision=a.precision,
        tensor_parallel=a.tensor_parallel_size if backend == "megatron" else 1,
        expert_parallel=a.expert_parallel_size if backend == "megatron" else 1,
        expert_tensor_parallel=a.expert_tensor_parallel_size if backend == "megatron" else None,
    )
    trainer = PolicyTrainer(
        policy, cfg, AlgorithmConfig(), temperature=1.0, total_optimizer_steps=a.steps + 1, dp=dp
    )
    first = trainer.train_step(copy.deepcopy(samples))  # warm-up (allocations, kernel selection)
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, mfu = [], []
    for _ in range(a.steps):
        start = time.perf_counter()
        metrics = trainer.train_step(copy.deepcopy(samples))
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        mfu.append(metrics.get("train/mfu"))
    times = dp.all_reduce_floats(times, "max")  # an update lasts as long as its slowest rank's
    seconds = sorted(times)[len(times) // 2]
    kernels = None
    if a.profile:
        update = functools.partial(trainer.train_step, copy.deepcopy(samples))
        kernels = profile_update(update, a.profile, model.device)
    tokens = metrics["train/tokens"]  # every rank's (the trainer's metrics are the whole batch's)
    result = {
        "backend": backend,
        "seconds_per_update": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": None if None in mfu else sorted(mfu)[len(mfu) // 2],  # None: unknown device peak (CPU)
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
        "peak_host_bytes": _peak_host_bytes(),
        "first_loss": first["train/loss"],
        "first_grad_norm": first["train/grad_norm"],
    }
    if kernels is not None:
        result["top_kernels"] = kernels
    if dp.enabled:
        result.update(largest_over_ranks(dp, result["peak_memory_bytes"], result["peak_host_bytes"]))
    del trainer, policy
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return result


def _peak_host_bytes() -> int:
    """This process's peak resident host memory so far (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str]) -> int:
    a = parse(argv)
    backends = [b for b in a.backend.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown --backend {unknown}; use {', '.join(BACKENDS)}")
    hide_gpus_from_cpu_ranks(a)
    check_sizes(a, model_args(a), backends)
    if needs_launch(a.nproc):
        print_report(launch_ranks(argv, a))
        return 0
    try:
        dp = init_data_parallel(a.nproc, a.device)  # torchrun's world, or the one `launch_ranks` started
    except MilesUserError as err:
        raise MilesUserError(as_flags(str(err))) from None
    try:
        report = run_backends(a, backends, dp)
    finally:
        shutdown(dp)
    if a.report_to:
        if dp.is_main:
            Path(a.report_to).write_text(json.dumps(report))
    elif dp.is_main:
        print_report(report)
    return 0


def run_backends(a: argparse.Namespace, backends: list[str], dp: DataParallel) -> dict[str, Any]:
    """Every backend on the same weights and samples (this rank's share of them); rank 0's report."""
    device = torch.device("cuda", dp.local_rank) if dp.on_cuda else pick_device(a.device)
    model = build_model(a, device)
    dp.broadcast_module(model)  # one set of starting weights, whatever each rank's generator drew
    samples = random_samples(a, model.args.vocab_size)
    mine = dp.shard(samples)
    params = sum(p.numel() for p in model.parameters())
    results = []
    for i, backend in enumerate(backends):
        # every backend starts from the same weights: the torch backend trains `model` itself (a copy of it
        # when another backend runs after it), as it trains the engine's module in a run
        last = i == len(backends) - 1
        results.append(
            bench_backend(
                backend,
                copy.deepcopy(model) if backend == "torch" and not last else model,
                mine,
                a,
                dp,
                len(samples),
            )
        )
    report = {
        "model": a.model,
        "layers": model.args.num_hidden_layers,
        "parameters": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": a.precision,
        "dtype": a.dtype,
        "master_weights": a.dtype != "float32" and not a.no_master_weights,
        "deepspeed": {
            "zero_stage": a.zero_stage,
            "offload_optimizer": a.offload_optimizer,
            "offload_param": a.offload_param,
            "extra": json.loads(a.deepspeed_extra),
        },
        "samples": a.samples,
        "tokens_per_sample": a.prompt_len + a.response_len,
        "results": results,
    }
    if dp.enabled:
        report["ranks"] = dp.world_size
        report["parallel"] = {
            "tensor": a.tensor_parallel_size,
            "expert": a.expert_parallel_size,
            "expert_tensor": a.expert_tensor_parallel_size or a.tensor_parallel_size,
        }
    return report


def print_report(report: dict[str, Any]) -> None:
    """The JSON line, then the table (the largest rank's memory with several ranks)."""
    print(json.dumps(report))
    params, layers = report["parameters"], report["layers"]
    masters = " + float32 masters" if report["master_weights"] else ""
    ranks = ""
    if "ranks" in report:
        sizes = report["parallel"]
        ranks = (
            f"; {report['ranks']} ranks, TP={sizes['tensor']} EP={sizes['expert']} "
            f"expert-TP={sizes['expert_tensor']}, the largest rank's peak memory"
        )
    print(
        f"\n{report['model']} ({params / 1e9:.2f} B parameters, {layers} layers), "
        f"{report['dtype']} weights{masters}, {report['precision']}{ranks}"
    )
    print("| backend | s / update | tokens/s | MFU | peak memory | first loss | first grad norm |")
    print("|---|---|---|---|---|---|---|")
    for r in report["results"]:
        memory = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r["peak_memory_bytes"] else "-"
        if "error" in r:
            print(f"| {r['backend']} | {r['error'][:60]} (reached {memory}) | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(
            f"| {r['backend']} | {r['seconds_per_update']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{memory} | {r['first_loss']:.6e} | {r['first_grad_norm']:.6e} |"
        )
    for r in report["results"]:
        if "top_kernels" in r:
            print_profile(r["backend"], r["top_kernels"], report["device"] != "cpu")


if __name__ == "__main__":
    raise SystemExit(rank_entry(main))
