"""`miles bench moe`: a MoE layer's experts at decode batch sizes, grouped GEMM vs the fused Triton kernels.

For each token count it builds `--layers` layers of a MoE preset's experts (random bf16 weights, uniform
random top-k routing per layer), captures the experts of all layers as one CUDA graph and times:

* `grouped`: the eager path (`Experts._grouped`: argsort, row gather, two `torch._grouped_mm`, SwiGLU, the
  routing-weight multiply, gather back to token order and the sum over slots);
* `grouped_mm`: the two grouped GEMMs alone, on pre-sorted rows (what the GEMMs cost without the dispatch);
* `fused`: `miles.models.fused_moe` (align, gate-up with SwiGLU, down with the routing weight, the sum).

Each is reported in ms per layer and as bandwidth over the experts the routing touched (their weight bytes
per layer over the time), against the device-to-device copy bandwidth. `--sweep` also times every tile
configuration of a small grid for each fused kernel and prints the best per token count (how the defaults
in fused_moe.py were chosen).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from miles.bench.common import graph_ms, measure_copy_bandwidth
from miles.models import fused_moe
from miles.models.moe import Experts
from miles.models.presets import preset_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench moe", description=__doc__)
    p.add_argument("--model", default="qwen3-30b-a3b", help="a MoE preset (tiny, qwen3-30b-a3b)")
    p.add_argument("--tokens", default="64,256,523,748", help="comma-separated decode batch sizes")
    p.add_argument("--layers", type=int, default=8, help="layers per graph (distinct weights: no L2 reuse)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    p.add_argument(
        "--grid",
        choices=("full", "focused"),
        default="full",
        help="sweep grid: full (row block 16/32/64 x 72 tiles, pointer loads) or focused (the row block the "
        "current table uses at each token count; column block 64/128/256, K block 64/128, 4 or 8 warps, "
        "pointer or TMA loads)",
    )
    p.add_argument(
        "--save-configs",
        default="",
        help="with --sweep: write the current tile tables with the swept ranges replaced by the fastest pair "
        f"to this JSON file (use it with {fused_moe.TILE_CONFIGS_ENV}=PATH or bench rollout --moe-configs)",
    )
    return p.parse_args(argv)


class MoeLayers:
    def __init__(self, model: str, layers: int) -> None:
        args = preset_args("qwen3_moe" if model == "tiny" else None, model)
        if not args.num_experts:
            raise SystemExit(f"miles bench moe: {model!r} is not a MoE preset")
        self.args = args
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.experts = []
        for _ in range(layers):
            ex = Experts(e, h, i).to(device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                ex.gate_up_proj.normal_(std=h**-0.5)
                ex.down_proj.normal_(std=i**-0.5)
            self.experts.append(ex)
        self.expert_bytes = 3 * h * i * 2

    def routing(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        k, h = self.args.num_experts_per_tok, self.args.hidden_size
        out = []
        for _ in self.experts:
            x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
            probs = torch.rand(tokens, self.args.num_experts, device="cuda").softmax(-1)
            weights, chosen = torch.topk(probs, k, dim=-1)
            out.append((x, chosen, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)))
        return out


def run_all(layers: MoeLayers, routed: list, fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for ex, (x, chosen, weights) in zip(layers.experts, routed, strict=True):
            fn(ex, x, chosen, weights)

    return run


def eager(ex: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return ex(x, chosen, weights)


def fused(
    ex: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, **cfg: Any
) -> torch.Tensor:
    return fused_moe.experts_forward(x, ex.gate_up_proj, ex.down_proj, chosen, weights, **cfg)


def grouped_mm_only(layers: MoeLayers, routed: list) -> Callable[[], None]:
    """The two grouped GEMMs on rows already sorted by expert (inputs prepared outside the graph)."""
    prepared = []
    for ex, (x, chosen, _) in zip(layers.experts, routed, strict=True):
        order = torch.argsort(chosen.reshape(-1), stable=True)
        rows = x[order // chosen.shape[1]]
        counts = torch.bincount(chosen.reshape(-1), minlength=ex.num_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        hidden = torch.empty(rows.shape[0], ex.intermediate_size, device="cuda", dtype=torch.bfloat16)
        prepared.append((ex, rows, offsets, hidden))

    def run() -> None:
        for ex, rows, offsets, hidden in prepared:
            torch._grouped_mm(rows, ex.gate_up_proj.transpose(-2, -1), offs=offsets)
            torch._grouped_mm(hidden, ex.down_proj.transpose(-2, -1), offs=offsets)

    return run


def sweep_grid(grid: str, block_m: int) -> list[fused_moe.TileConfig]:
    """The configurations `--sweep` times: `full` is the grid the defaults were chosen from; `focused` keeps
    one row block (the one the table uses at this size) and adds wider columns and TMA weight loads."""
    if grid == "full":
        return [
            fused_moe.TileConfig(bm, bn, bk, warps, stages)
            for bm, bn, bk, warps, stages in itertools.product(
                (16, 32, 64), (64, 128), (64, 128), (4, 8), (3, 4, 5)
            )
        ]
    tma = (False, True) if torch.cuda.get_device_capability() >= (9, 0) else (False,)
    return [
        fused_moe.TileConfig(block_m, bn, bk, warps, stages, use_tma)
        for bn, bk, (warps, stages), use_tma in itertools.product(
            (64, 128, 256), (64, 128), ((4, 3), (8, 4)), tma
        )
    ]


def main(argv: list[str]) -> int:
    a = parse(argv)
    if not torch.cuda.is_available() or not fused_moe.available():
        print("miles bench moe times GPU kernels: it needs a CUDA device and Triton", file=sys.stderr)
        return 2
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))
    layers = MoeLayers(a.model, a.layers)
    n_layers = len(layers.experts)
    rows: list[dict[str, Any]] = []
    for tokens in [int(t) for t in a.tokens.split(",") if t]:
        routed = layers.routing(tokens)
        touched = sum(int(torch.unique(c).numel()) for _, c, _ in routed) / n_layers
        bytes_per_layer = touched * layers.expert_bytes
        with torch.no_grad():
            ref = eager(layers.experts[0], *routed[0])
            got = fused(layers.experts[0], *routed[0])
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = {
                "grouped": graph_ms(run_all(layers, routed, eager), a.iters) / n_layers,
                "grouped_mm": graph_ms(grouped_mm_only(layers, routed), a.iters) / n_layers,
                "fused": graph_ms(run_all(layers, routed, fused), a.iters) / n_layers,
            }
            row: dict[str, Any] = {
                "tokens": tokens,
                "experts_touched": touched,
                "ms_per_layer": ms,
                "pct_of_copy_bandwidth": {
                    k: 100 * bytes_per_layer / (v / 1e3) / bandwidth for k, v in ms.items()
                },
                "fused_vs_grouped_rel_err": err,
            }
            if a.sweep:
                row["sweep"] = sweep(layers, routed, a.iters, a.grid, tokens)
        rows.append(row)
    if a.sweep and a.save_configs:
        tables = tuned_tables(layers, rows, a.iters)
        with open(a.save_configs, "w") as f:
            json.dump(fused_moe.tables_to_json(tables), f, indent=1)
        print(f"tile tables written to {a.save_configs}", file=sys.stderr)
    print(
        json.dumps({"model": a.model, "copy_bandwidth_bytes_per_s": bandwidth, "results": rows}), flush=True
    )
    print(f"{a.model} experts, {n_layers} layers per graph, copy {bandwidth / 1e12:.2f} TB/s")
    print(f"  {'tokens':>6} {'touched':>7} | {'grouped':>15} | {'grouped_mm':>15} | {'fused':>15} | rel err")
    for r in rows:
        cells = " | ".join(
            f"{r['ms_per_layer'][k]:7.3f} ms {r['pct_of_copy_bandwidth'][k]:3.0f}%"
            for k in ("grouped", "grouped_mm", "fused")
        )
        print(
            f"  {r['tokens']:>6} {r['experts_touched']:>7.1f} | {cells} | {r['fused_vs_grouped_rel_err']:.1e}"
        )
        for name, best in r.get("sweep", {}).items():
            print(f"      best {name}: {best}")
    return 0


def time_fused(layers: MoeLayers, routed: list, iters: int, **cfgs: fused_moe.TileConfig) -> float | None:
    """ms per layer of the fused experts with these configs, or None where they do not run here."""
    try:
        return graph_ms(run_all(layers, routed, functools.partial(fused, **cfgs)), iters) / len(
            layers.experts
        )
    except Exception as err:  # a tile too large for shared memory: skip it
        print(f"  {cfgs}: {type(err).__name__}", file=sys.stderr)
        return None


def sweep(layers: MoeLayers, routed: list, iters: int, grid: str, tokens: int) -> dict[str, Any]:
    """Best configs for each kernel (the other held at its default), then the best pair per row block
    (one expert layout serves both kernels) and the best pair overall (two layouts when the blocks differ)."""
    time = functools.partial(time_fused, layers, routed, iters)
    per_expert = tokens * layers.args.num_experts_per_tok / layers.args.num_experts
    best: dict[str, Any] = {}
    ranked: dict[str, list[tuple[float, fused_moe.TileConfig]]] = {}
    for which, table in (("up_cfg", fused_moe.tables.gate_up), ("down_cfg", fused_moe.tables.down)):
        configs = sweep_grid(grid, fused_moe.pick(table, per_expert).block_m)
        timed = [(ms, cfg) for cfg in configs if (ms := time(**{which: cfg})) is not None]
        ranked[which] = sorted(timed, key=lambda t: t[0])
        best[which] = [{"ms_per_layer": ms, "config": vars(cfg)} for ms, cfg in ranked[which][:3]]
    if not ranked["up_cfg"] or not ranked["down_cfg"]:
        return best  # no configuration of one kernel ran here
    pairs = {"best pair": (ranked["up_cfg"][0][1], ranked["down_cfg"][0][1])}
    for bm in sorted({cfg.block_m for _, cfg in ranked["up_cfg"]}):
        up = [cfg for _, cfg in ranked["up_cfg"] if cfg.block_m == bm]
        down = [cfg for _, cfg in ranked["down_cfg"] if cfg.block_m == bm]
        if up and down:
            pairs[f"block_m {bm}"] = (up[0], down[0])
    best["pairs"] = [
        {"name": name, "ms_per_layer": ms, "up": vars(up), "down": vars(down)}
        for name, (up, down) in pairs.items()
        if (ms := time(up_cfg=up, down_cfg=down)) is not None
    ]
    return best


def tuned_tables(layers: MoeLayers, rows: list[dict[str, Any]], iters: int) -> fused_moe.TileTables:
    """The current tables with each range that a swept token count falls in replaced by the candidate pair
    (the best pairs found at any token count of that range) with the least total time over the range's
    token counts."""
    k, e = layers.args.num_experts_per_tok, layers.args.num_experts
    current = fused_moe.tables
    limits = [limit for limit, _ in current.gate_up]
    if limits != [limit for limit, _ in current.down]:
        raise SystemExit("--save-configs needs the gate/up and down tables to share their ranges")
    by_range: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("sweep", {}).get("pairs"):
            index = next(i for i, limit in enumerate(limits) if r["tokens"] * k / e <= limit)
            by_range.setdefault(index, []).append(r)
    gate_up, down = list(current.gate_up), list(current.down)
    for index, members in by_range.items():
        candidates = {
            (fused_moe.TileConfig(**p["up"]), fused_moe.TileConfig(**p["down"]))
            for r in members
            for p in r["sweep"]["pairs"]
        }
        routings = [layers.routing(r["tokens"]) for r in members]
        totals = {}
        for up, dn in candidates:
            times = [time_fused(layers, routed, iters, up_cfg=up, down_cfg=dn) for routed in routings]
            if all(t is not None for t in times):
                totals[(up, dn)] = sum(times)  # type: ignore[arg-type]
        if totals:
            up, dn = min(totals, key=totals.__getitem__)
            gate_up[index], down[index] = (limits[index], up), (limits[index], dn)
    return fused_moe.TileTables(gate_up=gate_up, down=down)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
