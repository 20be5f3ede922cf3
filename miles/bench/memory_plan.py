"""The trainer's memory plan, per rank: replicated AdamW against the distributed optimizer, activation
recomputation and optimizer offload, on the same random weights and samples.

    python -m miles.bench.memory_plan --model qwen3-1.7b --dtype bfloat16
    torchrun --nproc_per_node 8 -m miles.bench.memory_plan --model qwen3-30b-a3b --layers 8 --dtype bfloat16

Each variant (`--variants`, comma-separated; options joined by `+`: `distributed`, `selective` / `full`,
`offload`) builds the model afresh, takes one warm-up update and `--steps` timed ones, each rank training on
its share of `--samples` sequences. Reported per variant, as the largest over the ranks:
  - `peak_update_gb`: device memory peak of an update (torch.cuda.max_memory_allocated);
  - `resident_gb`: device memory held between updates, which a colocated engine's KV pool competes with;
  - `optimizer_state_gb`: this rank's float32 masters + AdamW moments (on the host while offloaded);
  - `s_per_update`, `offload_s` (moving the state out and back per update), the first update's loss and
    gradient norm (every variant must agree on them: they train the same update).
`--json-out PATH` writes the JSON report there too, with each variant's tensor bytes by part (weights,
gradients, optimizer state, the engine's copy; miles/bench/memory_parts.py), the largest micro-batch's tokens
and the model's shape: what `python -m miles.bench.memory_table` extrapolates from two depths.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from miles.bench.memory_parts import GradientProbe, largest_micro_batch_tokens, state_parts
from miles.bench.train import build_model, model_args, random_samples
from miles.config import AlgorithmConfig, TrainerConfig
from miles.distributed import DataParallel, init_data_parallel, shutdown
from miles.model_io import pick_device
from miles.models.presets import PRESETS
from miles.trainer.backends import build_policy
from miles.trainer.offload import GB, OptimizerOffload
from miles.trainer.policy_trainer import PolicyTrainer

OPTIONS = ("replicated", "distributed", "selective", "full", "offload")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.bench.memory_plan", description=__doc__)
    p.add_argument("--model", default="qwen3-0.6b", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint")
    p.add_argument("--arch", default=None, help="with --model tiny: qwen3 | qwen3_moe | llama")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--backend", default="torch", help="torch | megatron")
    p.add_argument("--expert-parallel", type=int, default=1, help="megatron: ranks splitting the experts")
    p.add_argument(
        "--variants",
        default="replicated,distributed,distributed+selective,distributed+full,distributed+offload",
    )
    p.add_argument("--samples", type=int, default=32, help="sequences per update, over all the ranks")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1536)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype (bfloat16: float32 masters)")
    p.add_argument("--steps", type=int, default=2, help="timed updates after one warm-up update")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON report to PATH")
    return p.parse_args(argv)


def variant_config(variant: str, a: argparse.Namespace, total_samples: int) -> TrainerConfig:
    options = variant.split("+")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown variant option(s) {unknown} in {variant!r}; use {', '.join(OPTIONS)}")
    return TrainerConfig(
        backend=a.backend,
        global_batch_size=total_samples,
        micro_batch_tokens=a.micro_batch_tokens,
        precision=a.precision,
        lr=1e-6,
        max_steps=a.steps + 1,
        distributed_optimizer="distributed" in options,
        recompute="full" if "full" in options else "selective" if "selective" in options else "none",
        offload_optimizer_during_rollout="offload" in options,
    )


def run_variant(
    variant: str, a: argparse.Namespace, dp: DataParallel, device: torch.device
) -> dict[str, Any]:
    on_cuda = device.type == "cuda"
    model = build_model(a, device)
    samples = random_samples(a, model.args.vocab_size)
    cfg = variant_config(variant, a, len(samples))
    policy = build_policy(a.backend, model, precision=a.precision, expert_parallel=a.expert_parallel)
    trainer = PolicyTrainer(policy, cfg, AlgorithmConfig(), temperature=1.0, dp=dp)
    offload = OptimizerOffload(trainer, cfg.offload_optimizer_during_rollout)
    offload.to_host()
    probe = GradientProbe(trainer)
    mine = dp.shard(samples)
    times, offload_times, peaks, first = [], [], [], None
    for step in range(1 + a.steps):
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        moved = offload.to_device()
        metrics = trainer.train_step(copy.deepcopy(mine))
        moved += offload.to_host()
        if on_cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated(device) / GB)
        if step == 0:
            first = metrics
        else:
            times.append(time.perf_counter() - began)
            offload_times.append(moved)
    resident = torch.cuda.memory_allocated(device) / GB if on_cuda else 0.0
    parts = state_parts(trainer, model, probe, offload.state_bytes())
    mine_result = [
        max(peaks) if peaks else 0.0,
        resident,
        offload.state_bytes() / GB,
        sorted(times)[len(times) // 2],
        sorted(offload_times)[len(offload_times) // 2],
        *parts.values(),
        largest_micro_batch_tokens(mine, cfg.micro_batch_tokens),
    ]
    worst = dp.all_reduce_floats(mine_result, "max")
    assert first is not None
    del trainer, policy, model, offload
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    keys = ("peak_update_gb", "resident_gb", "optimizer_state_gb", "s_per_update", "offload_s")
    keys += (*parts, "micro_batch_tokens")
    figures = dict(zip(keys, worst))
    for key in (*parts, "micro_batch_tokens"):
        figures[key] = int(figures[key])
    return {
        "variant": variant,
        "recompute": cfg.recompute,
        "distributed_optimizer": cfg.distributed_optimizer,
        **figures,
        "first_loss": first["train/loss"],
        "first_grad_norm": first["train/grad_norm"],
    }


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = pick_device(a.device)
    dp = init_data_parallel(1, str(device))
    if dp.on_cuda:
        device = torch.device("cuda", dp.local_rank)
    try:
        results = [run_variant(v, a, dp, device) for v in a.variants.split(",") if v]
    finally:
        shutdown(dp)
    if not dp.is_main:
        return 0
    report = {"model": a.model, "layers": a.layers, "ranks": dp.world_size, "backend": a.backend}
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report["dtype"], report["precision"] = a.dtype, a.precision
    report["model_args"] = dataclasses.asdict(model_args(a))
    report["full_layers"] = model_args(argparse.Namespace(**{**vars(a), "layers": 0})).num_hidden_layers
    print(json.dumps({**report, "results": results}))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({**report, "results": results}, indent=1))
    print(f"\n{a.model}, {dp.world_size} rank(s), {a.backend}; the largest rank's figures")
    print(
        "| variant | peak update GB | resident GB | optimizer state GB | s / update | offload s | loss | grad norm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['peak_update_gb']:.2f} | {r['resident_gb']:.2f} | "
            f"{r['optimizer_state_gb']:.2f} | {r['s_per_update']:.3f} | {r['offload_s']:.3f} | "
            f"{r['first_loss']:.6g} | {r['first_grad_norm']:.6g} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
