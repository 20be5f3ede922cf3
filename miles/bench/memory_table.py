"""The memory of a full-depth MoE run on N GPUs, per GPU, from per-layer figures measured on one GPU.

    python -m miles.bench.memory_plan --model qwen3-30b-a3b --layers 4 --variants distributed+selective \\
        --json-out m4.json
    python -m miles.bench.memory_plan --model qwen3-30b-a3b --layers 8 --variants distributed+selective \\
        --json-out m8.json
    python -m miles.bench.memory_table m4.json m8.json --gpus 8 --expert-parallel-size 8 --offload \\
        --release-engine-weights

Two measurements of the same model, variant and micro-batch at two depths give, from their difference, one
decoder layer's weight, gradient and optimizer-state bytes (per parameter: the layer's bytes over its
parameters), the bytes outside the layers (embedding, LM head) and, from the device peaks (CUDA only), the
activation bytes per token and layer. A layer's bytes split into its experts' and the rest by parameter
count. Projected onto `--gpus` N with TP, EP and expert-TP (megatron's layout; DP = N / TP):
  - weights and gradients: dense parts and the vocabulary over TP, experts over EP x expert-TP;
  - optimizer state (float32 masters + moments): also sliced over the data-parallel ranks with the
    distributed optimizer (dense over N / TP, experts over the expert-data-parallel N / (EP x expert-TP));
  - activations: one micro-batch of `--micro-batch-tokens` (the measured one by default), not divided
    under TP (each TP rank holds every token's residual stream: no sequence parallelism);
  - the colocated engine's whole weights in the weights' dtype (it receives the gathered weights);
  - the peak of an update (its KV pool released for the update; the engine's weights beside it, or released
    too with `--release-engine-weights`, i.e. rollout.release_weights_during_train), what stays during
    rollout (the optimizer state leaves with `--offload`), and what is left for the KV cache of
    `--capacity-gb` less `--reserve-gb`, in tokens of the model's KV layout.
Not counted: the CUDA context, NCCL buffers, the all-to-all's token buffers and allocator fragmentation
(`--reserve-gb` holds them back), and the padding of optimizer slices (under one element per rank).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from miles.bench.memory_parts import parameter_counts
from miles.bench.train_ranks import as_flags
from miles.errors import MilesUserError
from miles.models import ModelArgs
from miles.trainer.offload import GB

PARTS = ("weight", "grad", "optimizer", "engine")
_KEYS = {
    "weight": "weight_bytes",
    "grad": "grad_bytes",
    "optimizer": "optimizer_state_bytes",
    "engine": "engine_copy_bytes",
}


@dataclass(frozen=True)
class Measured:
    """One depth's figures from `memory_plan --json-out` (one rank)."""

    layers: int
    bytes: dict[str, int]
    """PARTS -> bytes."""
    peak_update: int | None
    """Device peak of an update in bytes; None when measured without CUDA."""
    micro_batch_tokens: int


@dataclass(frozen=True)
class PerLayer:
    """What one decoder layer and the rest of the model take, from two depths."""

    layer_params: int
    layer_expert_params: int
    outside_params: int
    per_param: dict[str, float]
    """PARTS -> a decoder layer's bytes per parameter."""
    outside: dict[str, float]
    """PARTS -> bytes outside the decoder layers (embedding, final norm, LM head)."""
    activation_per_token_layer: float | None
    activation_per_token_outside: float | None
    """Activation bytes per micro-batch token: per layer, and outside the layers (logits); None without CUDA."""
    micro_batch_tokens: int


@dataclass(frozen=True)
class Layout:
    gpus: int
    tensor: int = 1
    expert: int = 1
    expert_tensor: int = 1
    distributed_optimizer: bool = True
    offload: bool = False
    release_engine_weights: bool = False
    """The engine's weights leave the device during the update (rollout.release_weights_during_train)."""


def read_measurement(path: str | Path, variant: str | None) -> tuple[dict[str, Any], Measured]:
    report = json.loads(Path(path).read_text())
    if report.get("ranks") != 1:
        raise MilesUserError(
            f"{path}: measured on {report.get('ranks')} ranks; measure on one GPU (python -m "
            "miles.bench.memory_plan without torchrun) so every tensor is whole"
        )
    results = {r["variant"]: r for r in report["results"]}
    name = variant or report["results"][0]["variant"]
    if name not in results:
        raise MilesUserError(f"{path} has no variant {name!r}; it has {', '.join(results)} (--variant)")
    r = results[name]
    missing = [k for k in (*_KEYS.values(), "micro_batch_tokens") if k not in r]
    if missing:
        raise MilesUserError(
            f"{path} lacks {missing}: write it with python -m miles.bench.memory_plan --json-out"
        )
    peak = round(r["peak_update_gb"] * GB) if report["device"] != "cpu" else None
    layers = report["model_args"]["num_hidden_layers"]
    figures = Measured(layers, {p: int(r[_KEYS[p]]) for p in PARTS}, peak, int(r["micro_batch_tokens"]))
    return {**report, "variant": name}, figures


def derive(a: Measured, b: Measured, args: ModelArgs) -> PerLayer:
    """Per-layer and outside-the-layers figures from two depths of one model (`args`: its shape)."""
    if a.layers == b.layers:
        raise MilesUserError(f"both measurements have {a.layers} layers; measure two depths (--layers)")
    if a.layers > b.layers:
        a, b = b, a
    if a.micro_batch_tokens != b.micro_batch_tokens:
        raise MilesUserError(
            f"the measurements' micro-batches differ ({a.micro_batch_tokens} and {b.micro_batch_tokens} tokens): "
            "measure both with the same --samples, --prompt-len, --response-len and --micro-batch-tokens"
        )
    counts = parameter_counts(args)
    depth = b.layers - a.layers
    layer = {p: (b.bytes[p] - a.bytes[p]) / depth for p in PARTS}
    outside = {p: a.bytes[p] - a.layers * layer[p] for p in PARTS}
    per_token_layer = per_token_outside = None
    if a.peak_update is not None and b.peak_update is not None:
        tokens = a.micro_batch_tokens
        activation_layer = (b.peak_update - a.peak_update) / depth - sum(layer.values())
        activation_outside = a.peak_update - sum(a.bytes.values()) - a.layers * activation_layer
        per_token_layer, per_token_outside = activation_layer / tokens, activation_outside / tokens
    return PerLayer(
        layer_params=counts["layer"],
        layer_expert_params=counts["layer_experts"],
        outside_params=counts["outside_layers"],
        per_param={p: layer[p] / counts["layer"] for p in PARTS},
        outside=outside,
        activation_per_token_layer=per_token_layer,
        activation_per_token_outside=per_token_outside,
        micro_batch_tokens=a.micro_batch_tokens,
    )


def check_layout(args: ModelArgs, layout: Layout) -> None:
    """The trainer's own layout checks (trainer/megatron/parallel.py, check_parallel_sizes), naming this tool's flags."""
    from miles.trainer.megatron.parallel import ParallelSizes, check_parallel_sizes

    if layout.gpus < 1:
        raise MilesUserError(f"--gpus must be at least 1, got {layout.gpus}")
    try:
        check_parallel_sizes(
            args, layout.gpus, ParallelSizes(layout.tensor, layout.expert, layout.expert_tensor)
        )
    except MilesUserError as err:
        raise MilesUserError(as_flags(str(err)).replace("--nproc", "--gpus")) from None


def project(
    per: PerLayer,
    args: ModelArgs,
    layout: Layout,
    micro_batch_tokens: int,
    capacity: float,
    reserve: float = 0.0,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Bytes per GPU of the `args.num_hidden_layers`-deep model in `layout` (see the module's docstring)."""
    from miles.rollout.kv.pool import KVLayout

    layers = args.num_hidden_layers
    experts = per.layer_expert_params
    dense = per.layer_params - experts
    model_split = experts / (layout.expert * layout.expert_tensor)
    replicas = layout.gpus // layout.tensor
    expert_replicas = layout.gpus // (layout.expert * layout.expert_tensor)

    def share(part: str, dense_ranks: int, expert_ranks: int) -> float:
        size = per.per_param[part]
        in_layers = layers * size * (dense / layout.tensor / dense_ranks + model_split / expert_ranks)
        return in_layers + per.outside[part] / layout.tensor / dense_ranks  # vocabulary-parallel

    sliced = layout.distributed_optimizer
    out: dict[str, Any] = {
        "weights": share("weight", 1, 1),
        "grads": share("grad", 1, 1),
        "optimizer_state": share("optimizer", replicas if sliced else 1, expert_replicas if sliced else 1),
        # the engine's whole model in the weights' dtype
        "engine_weights": layers * per.per_param["weight"] * per.layer_params + per.outside["weight"],
    }
    if per.activation_per_token_layer is None or per.activation_per_token_outside is None:
        activations = None
    else:
        per_token = layers * per.activation_per_token_layer + per.activation_per_token_outside
        activations = per_token * micro_batch_tokens
    out["activations"] = activations
    trainer_state = out["weights"] + out["grads"] + out["optimizer_state"]
    out["peak_update"] = None if activations is None else trainer_state + activations
    engine_in_update = 0.0 if layout.release_engine_weights else out["engine_weights"]
    out["update_with_engine"] = None if activations is None else out["peak_update"] + engine_in_update
    out["resident_rollout"] = (
        out["engine_weights"] + out["weights"] + (0.0 if layout.offload else out["optimizer_state"])
    )
    kv_bytes_per_token = KVLayout.for_model(args, kv_dtype, 1).bytes_per_token
    left = capacity - reserve - out["resident_rollout"]
    out["kv_cache"] = left
    out["kv_tokens"] = max(int(left // kv_bytes_per_token), 0)
    out["kv_bytes_per_token"] = kv_bytes_per_token
    # unknown (None) without the activations, unless rollout alone leaves nothing
    update_fits = None if activations is None else out["update_with_engine"] + reserve <= capacity
    out["fits"] = False if left <= 0 else update_fits
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.bench.memory_table", description=__doc__)
    p.add_argument(
        "measurements", nargs=2, help="two `memory_plan --json-out` files of one model at two depths"
    )
    p.add_argument("--variant", default=None, help="the variant to read (default: each file's first)")
    p.add_argument("--layers", type=int, default=0, help="depth to project (0: the model's full depth)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--expert-parallel-size", type=int, default=8)
    p.add_argument(
        "--expert-tensor-parallel-size", type=int, default=None, help="default: --tensor-parallel-size"
    )
    p.add_argument("--replicated-optimizer", action="store_true", help="every replica holds the whole state")
    p.add_argument("--offload", action="store_true", help="optimizer state on the host during rollout")
    p.add_argument(
        "--release-engine-weights",
        action="store_true",
        help="the engine's weights freed during the update (rollout.release_weights_during_train)",
    )
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="0: the measured micro-batch")
    p.add_argument("--capacity-gb", type=float, default=141.0, help="device memory (H200: 141)")
    p.add_argument(
        "--reserve-gb", type=float, default=0.0, help="held back: CUDA context, NCCL, fragmentation"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    (report, first), (_, second) = (read_measurement(m, a.variant) for m in a.measurements)
    measured_args = ModelArgs(**report["model_args"])
    per = derive(first, second, measured_args)
    args = replace(measured_args, num_hidden_layers=a.layers or report["full_layers"])
    layout = Layout(
        gpus=a.gpus,
        tensor=a.tensor_parallel_size,
        expert=a.expert_parallel_size,
        expert_tensor=a.expert_tensor_parallel_size or a.tensor_parallel_size,
        distributed_optimizer=not a.replicated_optimizer,
        offload=a.offload,
        release_engine_weights=a.release_engine_weights,
    )
    check_layout(args, layout)
    tokens = a.micro_batch_tokens or per.micro_batch_tokens
    per_gpu = project(per, args, layout, tokens, a.capacity_gb * GB, a.reserve_gb * GB)
    out = {
        "model": report["model"],
        "variant": report["variant"],
        "measured_on": report["device"],
        "measured_layers": sorted([first.layers, second.layers]),
        "layers": args.num_hidden_layers,
        "layout": asdict(layout),
        "micro_batch_tokens": tokens,
        "capacity_gb": a.capacity_gb,
        "reserve_gb": a.reserve_gb,
        "per_layer": asdict(per),
        "per_gpu": per_gpu,
    }
    print(json.dumps(out))
    print_table(out)
    return 0


def _gb(value: float | None) -> str:
    return "- (device peaks are measured on CUDA only)" if value is None else f"{value / GB:.2f}"


def print_table(out: dict[str, Any]) -> None:
    per, g, lay = out["per_layer"], out["per_gpu"], out["layout"]
    pp = per["per_param"]
    print(
        f"\n{out['model']}, {out['layers']} layers on {lay['gpus']} GPUs: TP={lay['tensor']} EP={lay['expert']} "
        f"expert-TP={lay['expert_tensor']}, "
        f"{'distributed' if lay['distributed_optimizer'] else 'replicated'} optimizer"
        f"{', offloaded during rollout' if lay['offload'] else ''}"
        f"{', engine weights released during the update' if lay['release_engine_weights'] else ''}; "
        f"variant {out['variant']} measured at "
        f"{out['measured_layers']} layers on {out['measured_on']}"
    )
    act = per["activation_per_token_layer"]
    print(
        f"per layer: {per['layer_params'] / 1e6:.1f} M parameters ({per['layer_expert_params'] / 1e6:.1f} M in "
        f"experts); bytes per parameter: weights {pp['weight']:.2f}, gradients {pp['grad']:.2f}, optimizer "
        f"{pp['optimizer']:.2f}; activations {'-' if act is None else f'{act / 1e3:.1f} kB'} per token and layer"
    )
    rows = [
        ("weights (this GPU's parts)", g["weights"]),
        ("gradients (during the update)", g["grads"]),
        ("optimizer state (float32 masters + moments)", g["optimizer_state"]),
        (f"activations, one micro-batch of {out['micro_batch_tokens']} tokens", g["activations"]),
        ("peak of an update (trainer)", g["peak_update"]),
        ("engine's whole weights", g["engine_weights"]),
        (
            "update, engine weights released too (KV pool released)"
            if lay["release_engine_weights"]
            else "update + engine weights (KV pool released)",
            g["update_with_engine"],
        ),
        ("resident during rollout (trainer + engine)", g["resident_rollout"]),
        (
            f"left for the KV cache of {out['capacity_gb']:g} GB (less {out['reserve_gb']:g} reserved)",
            g["kv_cache"],
        ),
    ]
    print("| per GPU | GB |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {_gb(value)} |")
    print(f"| KV tokens ({g['kv_bytes_per_token']} bytes each) | {g['kv_tokens']:,} |")
    fits = {True: "yes", False: "no", None: "unknown (no activation figures)"}[g["fits"]]
    print(f"| fits | {fits} |")


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except MilesUserError as err:
        raise SystemExit(f"python -m miles.bench.memory_table: error: {err}") from None
