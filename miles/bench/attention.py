"""`miles bench attention`: the paged decode attention kernels alone, against the KV bytes they must read.

A decode step of B sequences with C cached tokens each reads 2 · C · B · Hkv · D elements per layer; this
times one layer's `run` (median of CUDA-graph replays; `--timing eager` times the Python calls instead) for
each flashinfer variant the engine can use and reports the read bandwidth next to the device's measured copy
bandwidth. Random KV in a pool of the engine's layout
with scattered slots (page size 1 takes every other slot, so no sequence is contiguous).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from miles.bench.common import measure_copy_bandwidth, median_cuda_seconds
from miles.models.presets import preset_args

VARIANTS: dict[str, dict[str, Any]] = {
    "fa2-tensor-core": dict(use_tensor_cores=True, backend="fa2"),
    # As the engine's CUDA-graph decode plans it (fixed buffers; flashinfer then always runs its merge).
    "fa2-graph": dict(use_tensor_cores=True, backend="fa2", graph=True),
    "fa2-graph-no-split": dict(use_tensor_cores=True, backend="fa2", graph=True, disable_split_kv=True),
    # q as the engine passes it: a view of the [B, Hq + Hkv, D] q/k buffer (row stride (Hq + Hkv) * D).
    "fa2-graph-strided-q": dict(use_tensor_cores=True, backend="fa2", graph=True, strided_q=True),
    "fa2-cuda-core": dict(use_tensor_cores=False),
    # flashinfer's CUDA-core decode kernel as the engine's graph decode plans it (`rollout.flashinfer_decode`).
    "cuda-core-graph": dict(use_tensor_cores=False, graph=True),
    "fa3-tensor-core": dict(use_tensor_cores=True, backend="fa3"),
    # TensorRT-LLM's XQA decode kernel as flashinfer ships it (page size 16, 32, 64 or 128; no plan).
    "xqa": dict(xqa=True),
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench attention", description=__doc__)
    p.add_argument("--model", default="qwen3-8b", help="preset whose heads and head_dim to use")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--timing",
        choices=("graph", "eager"),
        default="graph",
        help="graph: calls captured in a CUDA graph, so the time is the kernels' alone; eager: CUDA events "
        "around each Python call, which includes its launch overhead (a small batch's kernels take less time "
        "than flashinfer's Python wrapper)",
    )
    p.add_argument(
        "--fixed-split-size",
        type=int,
        default=None,
        help="pages per split-KV chunk in the plan (flashinfer's fixed_split_size; tensor-core variants)",
    )
    p.add_argument(
        "--layout",
        choices=("NHD", "HND"),
        default="NHD",
        help="KV page layout: tokens outside heads (the engine's pool) or heads outside tokens",
    )
    return p.parse_args(argv)


def flashinfer_decode_run(
    options: dict[str, Any],
    workspace: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    fixed_split_size: int | None = None,
    layout: str = "NHD",
) -> Callable[[], torch.Tensor]:
    """A planned `BatchDecodeWithPagedKVCacheWrapper` as the engine would run it, ready to time."""
    import flashinfer

    graph = options.pop("graph", False)
    options.pop("strided_q", None)
    plan_options = (
        {"disable_split_kv": options.pop("disable_split_kv")} if "disable_split_kv" in options else {}
    )
    if fixed_split_size is not None and options.get("use_tensor_cores") and not plan_options:
        plan_options["fixed_split_size"] = fixed_split_size  # flashinfer takes it on split tensor-core plans
    if graph:
        options.update(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr.to(q.device),
            paged_kv_indices_buffer=indices.clone(),
            paged_kv_last_page_len_buffer=last.to(q.device),
        )
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, **options)
    wrapper.plan(
        indptr,
        indices,
        last,
        hq,
        hkv,
        d,
        page_size,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        **plan_options,
    )
    return lambda: wrapper.run(q, (k, v))


_CALLS_PER_GRAPH = 10


def graph_cuda_seconds(run: Callable[[], object], iters: int) -> float:
    """Device time of one `run`: the median replay of a CUDA graph of `_CALLS_PER_GRAPH` calls, divided."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # allocations for the capture's outputs happen outside it
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(_CALLS_PER_GRAPH):
            run()
    return median_cuda_seconds(graph.replay, iters, warmup=2) / _CALLS_PER_GRAPH


def time_variant(name: str, a: argparse.Namespace, hq: int, hkv: int, d: int) -> dict[str, Any]:
    import flashinfer

    device = torch.device("cuda")
    pages_per_seq = -(-a.context // a.page_size)
    stride = 2 if a.page_size == 1 else 1
    num_pages = a.batch * pages_per_seq * stride + 1
    k = torch.randn(num_pages, a.page_size, hkv, d, device=device, dtype=torch.bfloat16)
    if a.layout == "HND":  # the same values, heads outside tokens within each page
        k = k.transpose(1, 2).contiguous()
    v = torch.randn_like(k)
    order = torch.randperm(a.batch * pages_per_seq, device=device) * stride + 1
    indices = order.to(torch.int32)
    indptr = torch.arange(0, a.batch * pages_per_seq + 1, pages_per_seq, dtype=torch.int32)
    last = torch.full((a.batch,), a.context - (pages_per_seq - 1) * a.page_size, dtype=torch.int32)
    workspace = torch.zeros(1024 * 1024 * 1024, dtype=torch.uint8, device=device)
    if VARIANTS[name].get("strided_q"):
        q = torch.randn(a.batch, hq + hkv, d, device=device, dtype=torch.bfloat16)[:, :hq]
    else:
        q = torch.randn(a.batch, hq, d, device=device, dtype=torch.bfloat16)
    options = dict(VARIANTS[name])
    if options.pop("xqa", False):
        if a.page_size not in (16, 32, 64, 128):
            raise ValueError(f"XQA takes page sizes 16, 32, 64 or 128 (--page-size), not {a.page_size}")
        block_tables = indices.view(a.batch, pages_per_seq)
        seq_lens = torch.full((a.batch,), a.context, dtype=torch.int32, device=device)

        def run() -> torch.Tensor:
            return flashinfer.decode.xqa_batch_decode_with_kv_cache(
                q,
                (k, v),
                workspace,
                block_tables,
                seq_lens,
                a.context,
                bmm1_scale=d**-0.5,
                kv_layout=a.layout,
            )
    else:
        run = flashinfer_decode_run(
            options,
            workspace,
            indptr,
            indices,
            last,
            q,
            k,
            v,
            a.page_size,
            hq,
            hkv,
            d,
            a.fixed_split_size,
            a.layout,
        )
    out = run()
    # Against float32 math on the first sequences (the pages each one reads).
    ref = []
    for b in range(min(4, a.batch)):
        pages = indices[b * pages_per_seq : (b + 1) * pages_per_seq].long()
        kp, vp = (
            (k[pages], v[pages])
            if a.layout == "NHD"
            else (k[pages].transpose(1, 2), v[pages].transpose(1, 2))
        )
        kb = kp.reshape(-1, hkv, d)[: a.context].float()
        vb = vp.reshape(-1, hkv, d)[: a.context].float()
        qb = q[b].float().view(hkv, hq // hkv, d)
        scores = torch.einsum("kgd,tkd->kgt", qb, kb) * d**-0.5
        ref.append(torch.einsum("kgt,tkd->kgd", scores.softmax(-1), vb).reshape(hq, d))
    ref_t = torch.stack(ref)
    rel_err = float((out[: len(ref)].float() - ref_t).norm() / ref_t.norm())
    seconds = graph_cuda_seconds(run, a.iters) if a.timing == "graph" else median_cuda_seconds(run, a.iters)
    kv_bytes = 2 * a.batch * a.context * hkv * d * 2
    return {"variant": name, "seconds": seconds, "kv_bytes_per_s": kv_bytes / seconds, "rel_err": rel_err}


def main(argv: list[str]) -> int:
    a = parse(argv)
    if not torch.cuda.is_available():
        print("miles bench attention times flashinfer's GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    args = preset_args(None, a.model)
    hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, int(args.head_dim)  # type: ignore[arg-type]
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))
    results = []
    for name in a.variants.split(","):
        try:
            results.append(time_variant(name, a, hq, hkv, d))
        except Exception as err:  # a variant this flashinfer build or GPU lacks: report it and go on
            results.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
    report = {
        "model": a.model,
        "batch": a.batch,
        "context": a.context,
        "page_size": a.page_size,
        "fixed_split_size": a.fixed_split_size,
        "layout": a.layout,
        "timing": a.timing,
        "heads": [hq, hkv, d],
        "copy_bandwidth_bytes_per_s": bandwidth,
        "results": results,
    }
    print(json.dumps(report), flush=True)
    print(
        f"{a.model}: batch {a.batch} x context {a.context}, page {a.page_size}, copy {bandwidth / 1e12:.2f} TB/s"
    )
    for r in results:
        if "error" in r:
            print(f"  {r['variant']:<16}  {r['error']}")
        else:
            print(
                f"  {r['variant']:<16}  {r['seconds'] * 1e3:7.3f} ms  {r['kv_bytes_per_s'] / 1e12:5.2f} TB/s "
                f"({100 * r['kv_bytes_per_s'] / bandwidth:3.0f}% of copy)  rel err {r['rel_err']:.1e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
