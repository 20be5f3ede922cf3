"""The router and experts of a MoE layer at decode batch sizes as Triton kernels (the fused-MoE scheme of
SGLang and vLLM, written for this model's layout).

At decode sizes each expert sees a few dozen token rows and the layer is bound by reading the expert
weights. `torch._grouped_mm` streams them at ~71 % of copy bandwidth on the H200, and the dispatch around it
(an argsort, a gather of the token rows, SwiGLU, the routing-weight multiply, a gather back to token order)
adds about a dozen more kernels per layer. Here:

0. `_route_kernel` turns router logits into the top-k experts and their (renormalised) weights;
1. `_align_kernel` (one program per expert) lays the (token, slot) pairs out by expert, each expert's run
   padded to a multiple of the row block, in pair order (a stable sort), and notes which expert owns each
   row block;
2. `_gate_up_kernel` gathers its token rows straight from `x`, multiplies them by the expert's gate and up
   rows and applies SwiGLU before writing, so the [pairs, 2I] product never goes to memory;
3. `_down_kernel` multiplies by the down projection, scales by the routing weight and writes each pair's row
   at its own (token, slot) place, so the caller only sums over the slots.

Rounding follows the eager path (`Experts._grouped`): the GEMM results, SiLU, the SwiGLU product and the
weighted rows are each rounded to the activation dtype where eager rounds them. Nothing guarantees the
same summation order inside a GEMM as cuBLAS/CUTLASS; on the H200 both accumulate each row over K in order
and the outputs were bit-identical in every `miles bench moe` case.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, replace

import torch

from miles.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager experts run instead
    triton = None  # type: ignore[assignment]

# `tl.histogram(..., mask=)` arrived in Triton 3.4 (torch 2.8); older stacks use the grouped GEMMs.
_NEW_ENOUGH = triton is not None and tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 4)
log = logging.getLogger(__name__)
kernels = fused.KernelSwitch("fused MoE kernels", "running the grouped GEMMs", log)


def available() -> bool:
    return _NEW_ENOUGH and kernels.on


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """Load the weight tiles through a TMA descriptor (Hopper and newer) instead of per-thread pointers."""


TileTable = list[tuple[float, TileConfig]]
"""(largest average number of (token, slot) pairs per expert, config for up to that many), ascending; the
last limit is inf."""


@dataclass
class TileTables:
    """The tile configurations `experts_forward` picks from, per kernel."""

    gate_up: TileTable
    down: TileTable


# Chosen on the H200 with `miles bench moe --sweep` (docs/benchmarks.md) for the Qwen3-30B-A3B expert shapes
# (hidden 2048, expert width 768, 128 experts). Larger row blocks pay off once an expert has that many rows;
# the down projection (K = 768) prefers wider column tiles and TMA loads (`--grid focused`: ~1 % faster at
# 288 tokens, within 0.3 % above; the gate/up kernel gained nothing from either).
DEFAULT_TABLES = TileTables(
    gate_up=[
        (8.0, TileConfig(16, 64, 128, 4, 4)),
        (24.0, TileConfig(32, 64, 128, 4, 3)),
        (float("inf"), TileConfig(64, 64, 64, 4, 3)),
    ],
    down=[
        (8.0, TileConfig(16, 64, 128, 4, 4)),
        (24.0, TileConfig(16, 256, 64, 4, 3, tma=True)),
        # The gate/up kernel's row block: one expert layout serves both kernels.
        (float("inf"), TileConfig(64, 128, 64, 8, 4, tma=True)),
    ],
)
TILE_CONFIGS_ENV = "MILES_MOE_TILE_CONFIGS"
"""A JSON file of tile tables (`miles bench moe --sweep --save-configs PATH` writes one) used instead of the
defaults: configurations tuned for another GPU or expert shape."""


def pick(configs: TileTable, pairs_per_expert: float) -> TileConfig:
    return next(c for limit, c in configs if pairs_per_expert <= limit)


def tables_to_json(tables: TileTables) -> dict[str, list[dict[str, object]]]:
    return {
        name: [
            {"max_pairs_per_expert": None if limit == float("inf") else limit, **vars(cfg)}
            for limit, cfg in getattr(tables, name)
        ]
        for name in ("gate_up", "down")
    }


def tables_from_json(data: dict[str, object], source: str) -> TileTables:
    """The tables of `tables_to_json`'s form; a malformed file raises ValueError naming what is wrong."""
    fields = {f.name for f in dataclasses.fields(TileConfig)}
    required = {f.name for f in dataclasses.fields(TileConfig) if f.default is dataclasses.MISSING}
    parsed: dict[str, TileTable] = {}
    for name in ("gate_up", "down"):
        rows = data.get(name)
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{source}: needs a non-empty list {name!r} of tile configurations")
        table: TileTable = []
        for row in rows:
            if not isinstance(row, dict) or "max_pairs_per_expert" not in row:
                raise ValueError(
                    f"{source}: each {name} entry needs max_pairs_per_expert (null for no limit)"
                )
            cfg = {k: v for k, v in row.items() if k != "max_pairs_per_expert"}
            if not required <= set(cfg) <= fields:
                raise ValueError(
                    f"{source}: a {name} entry has keys {sorted(cfg)}; expected {sorted(fields)}"
                )
            limit = row["max_pairs_per_expert"]
            table.append((float("inf") if limit is None else float(limit), TileConfig(**cfg)))
        if table[-1][0] != float("inf") or [t[0] for t in table] != sorted(t[0] for t in table):
            raise ValueError(f"{source}: {name} limits must ascend and end with null (no limit)")
        parsed[name] = table
    return TileTables(**parsed)


def load_tables(path: str) -> TileTables:
    import json

    with open(path) as f:
        return tables_from_json(json.load(f), path)


tables = load_tables(os.environ[TILE_CONFIGS_ENV]) if os.environ.get(TILE_CONFIGS_ENV) else DEFAULT_TABLES
"""What `experts_forward` picks from; replace it (e.g. with `load_tables`) to try other configurations."""


if triton is not None:

    @triton.jit
    def _chunk_ids(expert_ptr, start, num_pairs, NUM_EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """(pair indices, expert ids) of one chunk of pairs; lanes past the end get id NUM_EXPERTS."""
        offs = start + tl.arange(0, CHUNK)
        return offs, tl.load(expert_ptr + offs, mask=offs < num_pairs, other=NUM_EXPERTS).to(tl.int32)

    @triton.jit
    def _count(ids, BINS: tl.constexpr, NUM_EXPERTS: tl.constexpr):
        # Ids outside [0, NUM_EXPERTS) are left out (their pairs are never computed) rather than counted into
        # a bin no program fills, which would leave unwritten rows inside `total`.
        return tl.histogram(ids, BINS, mask=(ids >= 0) & (ids < NUM_EXPERTS))

    @triton.jit
    def _store_ranks(dst_ptr, offs, ids, e):
        """Store the chunk's pairs of expert e, in pair order, from dst_ptr on; returns how many there were."""
        hit = (ids == e).to(tl.int32)
        tl.store(dst_ptr + tl.cumsum(hit, 0) - 1, offs, mask=hit > 0)
        return tl.sum(hit)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _align_kernel(
        expert_ptr,  # [P] expert id of each (token, slot) pair
        sorted_pairs_ptr,  # out: [capacity] pair index per padded row (P = padding)
        block_expert_ptr,  # out: [capacity // BM] expert of each row block
        total_ptr,  # out: [1] rows in use (a multiple of BM)
        num_pairs,
        NUM_EXPERTS: tl.constexpr,
        BINS: tl.constexpr,  # NUM_EXPERTS rounded up to a power of two
        BM: tl.constexpr,
        CHUNK: tl.constexpr,
        ONE_CHUNK: tl.constexpr,  # num_pairs <= CHUNK: the ids are loaded once, for the counts and the ranks
    ):
        e = tl.program_id(0)
        # Every program counts all experts (the pairs are few) so no second launch is needed for offsets.
        if ONE_CHUNK:
            offs, ids = _chunk_ids(expert_ptr, 0, num_pairs, NUM_EXPERTS, CHUNK)
            counts = _count(ids, BINS, NUM_EXPERTS)
        else:
            counts = tl.zeros([BINS], dtype=tl.int32)
            for start in range(0, num_pairs, CHUNK):
                offs, ids = _chunk_ids(expert_ptr, start, num_pairs, NUM_EXPERTS, CHUNK)
                counts += _count(ids, BINS, NUM_EXPERTS)
        # Each expert's run starts where the previous one's, padded to a multiple of BM, ends.
        padded = (counts + BM - 1) // BM * BM
        mine = tl.arange(0, BINS) == e
        my_padded = tl.sum(tl.where(mine, padded, 0))
        my_count = tl.sum(tl.where(mine, counts, 0))
        my_start = tl.sum(tl.where(mine, tl.cumsum(padded, 0), 0)) - my_padded
        if e == 0:
            tl.store(total_ptr, tl.sum(padded))
        if ONE_CHUNK:
            _store_ranks(sorted_pairs_ptr + my_start, offs, ids, e)
        else:
            seen = 0
            for start in range(0, num_pairs, CHUNK):
                offs, ids = _chunk_ids(expert_ptr, start, num_pairs, NUM_EXPERTS, CHUNK)
                seen += _store_ranks(sorted_pairs_ptr + my_start + seen, offs, ids, e)
        pad = tl.arange(0, BM)
        tl.store(sorted_pairs_ptr + my_start + my_count + pad, num_pairs, mask=pad < my_padded - my_count)
        for b in range(0, my_padded // BM):
            tl.store(block_expert_ptr + my_start // BM + b, e)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _route_kernel(
        logits_ptr,  # [T, E] router logits
        weights_ptr,  # out: [T, K] gating weights (activation dtype)
        chosen_ptr,  # out: [T, K] expert ids (int64), highest probability first
        valid_ptr,  # [1] rows in use (the rest are CUDA-graph padding); read only when HAS_VALID
        num_tokens,
        num_experts,
        stride_logits,
        TOP_K: tl.constexpr,
        K_BINS: tl.constexpr,  # TOP_K rounded up to a power of two
        BINS: tl.constexpr,  # num_experts rounded up to a power of two
        ROWS: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_VALID: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BINS)
        row_ok = rows < num_tokens
        mask = row_ok[:, None] & (cols < num_experts)[None, :]
        ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :]
        logits = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
        logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past the end: finite, never stored
        exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        probs = exps / tl.sum(exps, axis=1)[:, None]
        # A NaN/inf row (a diverged policy) still picks valid experts (its weights stay NaN, as eager's do);
        # padding columns can never be picked.
        ranked = tl.where(probs == probs, probs, -1.0)
        ranked = tl.where((cols < num_experts)[None, :], ranked, float("-inf"))
        slots = tl.arange(0, K_BINS)
        picked = tl.zeros([ROWS, K_BINS], dtype=tl.float32)
        ids = tl.zeros([ROWS, K_BINS], dtype=tl.int64)
        total = tl.zeros([ROWS], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(ranked, axis=1)
            # Among equal probabilities the lowest expert id (torch.topk leaves tie order unspecified; with
            # routing replay the trainer uses whatever the engine chose).
            best_id = tl.min(tl.where(ranked == best[:, None], cols[None, :], BINS), axis=1)
            hit = cols[None, :] == best_id[:, None]
            prob = tl.sum(tl.where(hit, probs, 0.0), axis=1)
            picked = tl.where(slots[None, :] == j, prob[:, None], picked)
            ids = tl.where(slots[None, :] == j, best_id[:, None].to(tl.int64), ids)
            total += prob
            ranked = tl.where(hit, float("-inf"), ranked)
        if RENORMALIZE:
            picked = picked / total[:, None]
        if HAS_VALID:  # padding rows route to no expert: the align kernel leaves id num_experts out
            padding = rows >= tl.load(valid_ptr)
            ids = tl.where(padding[:, None], num_experts, ids)
            picked = tl.where(padding[:, None], 0.0, picked)
        out_mask = row_ok[:, None] & (slots < TOP_K)[None, :]
        offs = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
        tl.store(weights_ptr + offs, picked.to(weights_ptr.dtype.element_ty), mask=out_mask)
        tl.store(chosen_ptr + offs, ids, mask=out_mask)

    @triton.jit
    def _block_pairs(block, block_expert_ptr, sorted_pairs_ptr, num_pairs, BM: tl.constexpr):
        """(expert, pair ids [BM], which of them are real pairs) of a row block in use: the prologue of both
        expert kernels."""
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        pair = tl.load(sorted_pairs_ptr + block * BM + tl.arange(0, BM))
        return expert, pair, (pair >= 0) & (pair < num_pairs)

    @triton.jit
    def _weight_tile(w_ptr, ptrs, row, k0, mask, TMA: tl.constexpr):
        """[BK, BN] tile of K-contiguous weight rows from column k0: through the TMA descriptor `w_ptr` (its
        box at `row` of the [E * rows, K] view) when TMA, else from the pointer tile `ptrs` (column 0)."""
        if TMA:
            tile = w_ptr.load([row.to(tl.int32), k0]).T
        else:
            tile = tl.load(ptrs + k0, mask=mask, other=0.0)
        return tile

    @triton.jit(do_not_specialize=["num_pairs"])
    def _gate_up_kernel(
        x_ptr,  # [T, K] token rows
        w_ptr,  # [E, 2N, K] gate rows then up rows (a TMA descriptor over [E * 2N, K] when TMA)
        out_ptr,  # [P, N] SwiGLU output per pair
        sorted_pairs_ptr,
        block_expert_ptr,
        total_ptr,
        num_pairs,
        N,
        K,
        top_k,
        stride_x,
        stride_wn,
        stride_out,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        block, tile_n = pid // tiles_n, pid % tiles_n
        if block * BM >= tl.load(total_ptr):
            return
        expert, pair, real = _block_pairs(block, block_expert_ptr, sorted_pairs_ptr, num_pairs, BM)
        cols = tl.arange(0, BN)
        col_ok = tile_n * BN + cols < N
        gate_row = expert * (2 * N) + tile_n * BN  # rows of the [E * 2N, K] view; the up rows are N further
        token = (pair // top_k).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
        if TMA:
            g_ptrs = w_ptr  # unused: the descriptor addresses the tiles
            u_ptrs = w_ptr
        else:
            g_ptrs = w_ptr + (gate_row + cols)[None, :].to(tl.int64) * stride_wn + ks[:, None]
            u_ptrs = g_ptrs + N * stride_wn
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            g = _weight_tile(w_ptr, g_ptrs, gate_row, k0, w_mask, TMA)
            u = _weight_tile(w_ptr, u_ptrs, gate_row + N, k0, w_mask, TMA)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BK
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        hidden = (silu * up).to(dtype)
        o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_out + (tile_n * BN + cols)[None, :]
        tl.store(o_ptrs, hidden, mask=real[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _down_kernel(
        h_ptr,  # [P, K] SwiGLU output per pair
        w_ptr,  # [E, N, K] (a TMA descriptor over [E * N, K] when TMA)
        weight_ptr,  # [P] routing weight per pair
        out_ptr,  # [P, N] weighted expert output per pair
        sorted_pairs_ptr,
        block_expert_ptr,
        total_ptr,
        num_pairs,
        N,
        K,
        stride_h,
        stride_wn,
        stride_out,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        block, tile_n = pid // tiles_n, pid % tiles_n
        if block * BM >= tl.load(total_ptr):
            return
        expert, pair, real = _block_pairs(block, block_expert_ptr, sorted_pairs_ptr, num_pairs, BM)
        cols = tl.arange(0, BN)
        col_ok = tile_n * BN + cols < N
        w_row = expert * N + tile_n * BN  # rows of the [E * N, K] view
        rows = pair.to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + rows[:, None] * stride_h + ks[None, :]
        if TMA:
            w_ptrs = w_ptr  # unused: the descriptor addresses the tiles
        else:
            w_ptrs = w_ptr + (w_row + cols)[None, :].to(tl.int64) * stride_wn + ks[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            w = _weight_tile(w_ptr, w_ptrs, w_row, k0, k_ok[:, None] & col_ok[None, :], TMA)
            acc = tl.dot(a, w, acc)
            a_ptrs += BK
        dtype = out_ptr.dtype.element_ty
        routing = tl.load(weight_ptr + pair, mask=real, other=0.0).to(tl.float32)
        weighted = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
        o_ptrs = out_ptr + rows[:, None] * stride_out + (tile_n * BN + cols)[None, :]
        tl.store(o_ptrs, weighted, mask=real[:, None] & col_ok[None, :])


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    valid_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype`, chosen [T, k] int64): float32 softmax over the experts, the top k (highest
    first), optionally renormalised over them; one kernel instead of softmax, topk, sum, divide and cast.

    `valid_rows` ([1] int32 on the device) marks the rows from that index on as padding: they get expert id
    E and weight 0, so `experts_forward` computes nothing for them."""
    num_tokens, num_experts = router_logits.shape
    router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=router_logits.device)
    chosen = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    rows = 4
    _route_kernel[(triton.cdiv(num_tokens, rows),)](
        router_logits,
        weights,
        chosen,
        chosen if valid_rows is None else valid_rows,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        K_BINS=triton.next_power_of_2(top_k),
        BINS=triton.next_power_of_2(num_experts),
        ROWS=rows,
        RENORMALIZE=renormalize,
        HAS_VALID=valid_rows is not None,
    )
    return weights, chosen


@dataclass
class Layout:
    """Pairs grouped by expert, each expert's run padded to the row block (device tensors, fixed shapes)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    total: torch.Tensor
    block_m: int


def align(chosen: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    num_pairs = chosen.numel()
    # At most min(E, P) experts are in use, each padding by fewer than block_m rows: a fixed bound, so the
    # launch sizes do not depend on the routing (no host sync, CUDA-graph safe).
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    device = chosen.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    # One chunk holds a decode step's pairs (1,024 tokens x top-8); prefill-sized calls loop over chunks.
    chunk = min(8192, max(16, triton.next_power_of_2(num_pairs)))
    _align_kernel[(num_experts,)](
        chosen.reshape(-1),
        sorted_pairs,
        block_expert,
        total,
        num_pairs,
        NUM_EXPERTS=num_experts,
        BINS=triton.next_power_of_2(num_experts),
        BM=block_m,
        CHUNK=chunk,
        ONE_CHUNK=num_pairs <= chunk,
        num_warps=16 if chunk >= 4096 else 8,
    )
    return Layout(sorted_pairs, block_expert, total, block_m)


def _on_device(cfg: TileConfig, device: torch.device) -> TileConfig:
    """The config, with pointer loads where the device has no TMA unit (before Hopper)."""
    if cfg.tma and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return replace(cfg, tma=False)
    return cfg


def _weights(w: torch.Tensor, cfg: TileConfig) -> object:
    """An expert kernel's weight operand: the [E, rows, K] tensor, or a TMA descriptor over its
    [E * rows, K] view with the config's [BN, BK] box."""
    if not cfg.tma:
        return w
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [cfg.block_n, cfg.block_k])


def experts_forward(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    up_cfg: TileConfig | None = None,
    down_cfg: TileConfig | None = None,
    sum_slots: bool = True,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for each token t.

    x: [T, H]; gate_up_proj: [E, 2I, H]; down_proj: [E, H, I]; chosen: [T, k] ids in [0, E) (others are
    skipped and leave their slot's row undefined); weights: [T, k] in x's dtype.
    With `sum_slots=False` it returns the [T, k, H] weighted outputs per slot, for the caller to fold the sum
    into another kernel.
    """
    num_tokens, top_k = chosen.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    x = x.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    per_expert = num_pairs / num_experts
    up_cfg = _on_device(up_cfg or pick(tables.gate_up, per_expert), x.device)
    down_cfg = _on_device(down_cfg or pick(tables.down, per_expert), x.device)
    up_layout = align(chosen, num_experts, up_cfg.block_m)
    down_layout = (
        up_layout if down_cfg.block_m == up_cfg.block_m else align(chosen, num_experts, down_cfg.block_m)
    )

    swiglu = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    blocks = up_layout.sorted_pairs.numel() // up_cfg.block_m
    _gate_up_kernel[(blocks * triton.cdiv(inter, up_cfg.block_n),)](
        x,
        _weights(gate_up_proj, up_cfg),
        swiglu,
        up_layout.sorted_pairs,
        up_layout.block_expert,
        up_layout.total,
        num_pairs,
        inter,
        hidden,
        top_k,
        x.stride(0),
        gate_up_proj.stride(1),
        swiglu.stride(0),
        BM=up_cfg.block_m,
        BN=up_cfg.block_n,
        BK=up_cfg.block_k,
        TMA=up_cfg.tma,
        num_warps=up_cfg.num_warps,
        num_stages=up_cfg.num_stages,
    )
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    blocks = down_layout.sorted_pairs.numel() // down_cfg.block_m
    _down_kernel[(blocks * triton.cdiv(hidden, down_cfg.block_n),)](
        swiglu,
        _weights(down_proj, down_cfg),
        weights.reshape(-1).contiguous(),
        out,
        down_layout.sorted_pairs,
        down_layout.block_expert,
        down_layout.total,
        num_pairs,
        hidden,
        inter,
        swiglu.stride(0),
        down_proj.stride(1),
        out.stride(0),
        BM=down_cfg.block_m,
        BN=down_cfg.block_n,
        BK=down_cfg.block_k,
        TMA=down_cfg.tma,
        num_warps=down_cfg.num_warps,
        num_stages=down_cfg.num_stages,
    )
    slots = out.view(num_tokens, top_k, hidden)
    return slots.sum(dim=1) if sum_slots else slots
