"""`miles bench sync`: one weight sync trainer -> engine process over a transport, against a plain copy.

The trainer side (this process) holds random weights of a preset; an engine process (miles/placement/
engine_process.py) holds other random weights of the same shape. One verified sync proves the transport
(`checksum_ok`: the engine's fingerprints of what it holds equal the sender's); then `--repeats` unverified
syncs are timed (`seconds`: from the sync's start until the engine reports it holds every tensor, its device
work done; the median). `copy_floor_s` is a device-to-device copy of the same tensors in this process (each
into a preallocated buffer), measured in the same run; `ratio_to_copy_floor` is seconds over it. Peak memory
is each side's during the timed syncs (CUDA: the allocator's peak; CPU: the process's peak RSS).

shm and cuda_ipc go direct (`path`: "direct"; the engine copies straight from the trainer's parameters,
shared at the verified sync) unless `--no-direct` (`path`: "buckets", packed into a pool of buckets).

    miles bench sync --model qwen3-8b --transport cuda_ipc                         # two processes, one GPU
    miles bench sync --model qwen3-8b --transport cuda_ipc --no-direct --bucket-mb 512
    miles bench sync --model tiny --arch qwen3_moe --transport shm --device cpu    # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from miles.config import RolloutConfig
from miles.model_io import pick_device
from miles.models.presets import PRESETS, build_random_model, preset_args
from miles.placement.engine_process import EngineProcess, EngineSpec
from miles.weight_sync import TRANSPORTS, TransportWeightSync, make_sender, trainer_stream
from miles.weight_sync.result import TransportSyncResult


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench sync", description=__doc__)
    p.add_argument("--model", default="qwen3-0.6b", help=f"a preset: {', '.join(PRESETS)}")
    p.add_argument("--arch", default=None, help="with --model tiny: qwen3 | qwen3_moe | llama")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument(
        "--transport",
        default="shm",
        choices=[t for t in TRANSPORTS if t != "inprocess"],
        help="the transport",
    )
    p.add_argument("--bucket-mb", type=float, default=512.0, help="one bucket's size (MiB)")
    p.add_argument("--buffers", type=int, default=2, help="buckets in the pool (2: double buffering)")
    p.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="shm, cuda_ipc: pack into buckets instead of copying straight from the trainer's parameters",
    )
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 (default: bfloat16 on GPU, float32 on CPU)"
    )
    p.add_argument("--device", default="auto", help="the trainer's device: auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--engine-device",
        default=None,
        help="the engine's device (default: the trainer's; broadcast on GPUs: the next GPU, NCCL wants one each)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed syncs after the verified one")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in each process")
    return p.parse_args(argv)


def engine_device(a: argparse.Namespace, device: torch.device) -> str:
    if a.engine_device is not None:
        return a.engine_device
    if a.transport == "broadcast" and device.type == "cuda":
        if torch.cuda.device_count() < 2:
            raise SystemExit(
                "miles bench sync: broadcast over NCCL needs the engine on a GPU of its own (NCCL refuses two "
                "ranks on one GPU); run it with 2 GPUs, or --transport cuda_ipc for two processes on one GPU"
            )
        return f"cuda:{((device.index or 0) + 1) % torch.cuda.device_count()}"
    return str(device)


def copy_floor_seconds(model: torch.nn.Module, device: torch.device, repeats: int) -> float:
    """A device-to-device copy of the model's tensors, each into a preallocated buffer (median of repeats):
    the bytes the engine holds (trainer and engine share one dtype here)."""
    tensors = [t for _, t in trainer_stream(model)]
    largest = max(t.numel() * t.element_size() for t in tensors)
    scratch = torch.empty(largest, dtype=torch.uint8, device=device)
    times = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for t in tensors:
            scratch[: t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    device = pick_device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args = preset_args(a.arch, a.model)
    if a.layers:
        args = replace(args, num_hidden_layers=min(a.layers, args.num_hidden_layers))
    # A small KV pool: the engine only takes weights here (on a GPU it shares the device with the trainer).
    rollout = RolloutConfig(kv_cache_bytes=16 * 1024**2, kv_cache_fraction=0.02, cuda_graph=False)
    spec = EngineSpec(
        preset=a.model,
        arch=a.arch,
        layers=a.layers,
        seed=0,
        dtype=dtype,
        device=engine_device(a, device),
        rollout=rollout,
        num_threads=a.threads,
    )
    engine = EngineProcess(spec, name="engine-0", timeout_s=a.timeout_s).start()
    try:
        model = build_random_model(args, dtype, device, seed=1)
        sender = make_sender(
            a.transport,
            [engine.sync_channel],
            a.bucket_mb,
            a.timeout_s,
            device=device,
            direct=a.direct,
            buffers=a.buffers,
        )
        sender.connect()
        try:
            with torch.no_grad():  # the loop's own sync: direct where the sender and the stream allow it
                verified = TransportWeightSync(model, sender, verify=True).sync(1)
                timing = TransportWeightSync(model, sender, verify=False, measure_memory=True)
                timed = [timing.sync(2 + i) for i in range(max(1, a.repeats))]
                floor = copy_floor_seconds(model, device, a.repeats)
        finally:
            sender.close()
    finally:
        engine.close()
    report = summarize(a, device, dtype, model, verified, timed, floor)
    print(json.dumps(report))
    print_table(report)
    return 0 if report["checksum_ok"] else 1


def summarize(
    a: argparse.Namespace,
    device: torch.device,
    dtype: str,
    model: torch.nn.Module,
    verified: TransportSyncResult,
    timed: list[TransportSyncResult],
    floor: float,
) -> dict[str, object]:
    seconds = statistics.median(r.seconds for r in timed)
    nbytes = timed[0].bytes
    return {
        "model": a.model,
        "layers": model.args.num_hidden_layers,  # type: ignore[union-attr]
        "transport": a.transport,
        "path": timed[0].path,
        "device": str(device),
        "dtype": dtype,
        "bucket_mb": a.bucket_mb,
        "buffers": a.buffers,
        "buckets": timed[0].buckets,
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9,
        "copy_floor_s": floor,
        "ratio_to_copy_floor": seconds / floor if floor > 0 else None,
        "checksum_ok": verified.checksum_ok,
        "mismatched": verified.mismatched[:5],
        "verified_seconds": verified.seconds,
        "verify_seconds": verified.verify_seconds,
        "trainer_peak_bytes": max(r.sender_peak_bytes for r in timed),
        "engine_peak_bytes": max(r.engine_peak_bytes for r in timed),
        "memory_kind": timed[0].memory_kind,
    }


def print_table(r: dict[str, object]) -> None:
    gib = 2**30
    rows = [
        ("model", f"{r['model']} ({r['layers']} layers, {r['dtype']}, {r['bytes'] / gib:.2f} GiB)"),  # type: ignore[operator]
        (
            "transport",
            f"{r['transport']} on {r['device']}, direct from the trainer's parameters"
            if r["path"] == "direct"
            else f"{r['transport']} on {r['device']}, {r['buffers']} x {r['bucket_mb']} MiB buckets ({r['buckets']} a sync)",
        ),
        ("sync", f"{r['seconds']:.4f} s ({r['gb_per_s']:.2f} GB/s)"),
        (
            "copy floor",
            f"{r['copy_floor_s']:.4f} s (x{r['ratio_to_copy_floor']:.2f})"
            if r["ratio_to_copy_floor"]
            else "-",
        ),
        (
            "verified sync",
            f"{r['verified_seconds']:.4f} s (engine's check {r['verify_seconds']:.4f} s), checksum_ok {r['checksum_ok']}",
        ),
        (
            "peak memory",
            f"trainer {r['trainer_peak_bytes'] / gib:.2f} GiB, engine {r['engine_peak_bytes'] / gib:.2f} GiB ({r['memory_kind']})",
        ),  # type: ignore[operator]
    ]
    print("\n| | |\n|---|---|")
    for key, value in rows:
        print(f"| {key} | {value} |")
