"""`miles bench layers`: the kernels of one decode step alone, and whether GEMMs can hide under attention.

A decode step of a dense model runs, per layer, the QKV GEMM, paged attention (flashinfer, reading every
cached token's K and V), the output GEMM and the MLP GEMMs, then the lm_head once. At a large batch the
GEMMs are compute-bound and the attention is bandwidth-bound, so the bytes roofline (all bytes over the copy
bandwidth) is only reachable if the two run at the same time. This times, as CUDA graphs on random weights
of a preset's shape (elementwise work left out, so these are lower bounds for an engine):

* `gemms` / `attention`: each part alone for the whole batch;
* `serial`: the step as an engine runs it, one kernel after another;
* `serial-2mb`: the batch as two micro-batches, one after the other (the cost of splitting);
* `overlap-2mb`: two micro-batches in anti-phase on two streams, one micro-batch's attention next to the
  other's GEMMs (two-batch overlap);
* `green-N` (with `--green-sms`): the same with the SMs partitioned by CUDA green contexts, N for attention;
* `attention-green-N`: attention alone confined to N SMs (how many SMs it needs to stream the KV);
* `overlap-gemm-green-N`: two-batch overlap with only the GEMMs confined (to all SMs but N), attention free
  to take any SM the GEMMs leave;
* `gemms-carve-N` / `overlap-carve-N` (with `--carveout`): cuBLASLt told to leave N SMs free
  (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET` through torch's SM carveout), alone and under two-batch overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from miles.bench.common import decode_weight_bytes, graph_ms, measure_copy_bandwidth
from miles.models.presets import preset_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench layers", description=__doc__)
    p.add_argument(
        "--model", default="qwen3-8b", help="a dense preset (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b)"
    )
    p.add_argument("--batch", type=int, default=524, help="decode batch (the 8B bench's average: 524)")
    p.add_argument("--context", type=int, default=749, help="cached tokens per sequence (8B bench: 749)")
    p.add_argument("--page-size", type=int, default=1, help="KV tokens per page (the engine's default: 16)")
    p.add_argument("--green-sms", default="", help="comma-separated SM counts for attention, e.g. 48,64")
    p.add_argument("--carveout", default="", help="comma-separated SM counts cuBLASLt GEMMs leave free")
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args(argv)


class DecodeStep:
    """Random weights and a scattered paged KV pool of a dense preset, at one batch and context."""

    def __init__(self, model: str, batch: int, context: int, page_size: int = 1) -> None:
        import flashinfer

        args = preset_args(None, model)
        if args.num_experts:
            raise SystemExit("miles bench layers: dense presets only (the MoE GEMMs depend on the routing)")
        self.args, self.batch, self.context = args, batch, context
        dev, bf = torch.device("cuda"), torch.bfloat16
        h, i, d = args.hidden_size, args.intermediate_size, int(args.head_dim)  # type: ignore[arg-type]
        self.hq, self.hkv, self.d, self.i = args.num_attention_heads, args.num_key_value_heads, d, i
        qkv = (self.hq + 2 * self.hkv) * d

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=dev, dtype=bf) * cols**-0.5

        self.layers = [
            dict(qkv=weight(qkv, h), o=weight(h, self.hq * d), gate_up=weight(2 * i, h), down=weight(h, i))
            for _ in range(args.num_hidden_layers)
        ]
        self.lm_head = weight(args.vocab_size, h)
        self.page_size = page_size
        self.pages_per_seq = -(-context // page_size)
        pages = batch * self.pages_per_seq
        self.k = [torch.randn(pages, page_size, self.hkv, d, device=dev, dtype=bf) for _ in self.layers]
        self.v = [torch.randn(pages, page_size, self.hkv, d, device=dev, dtype=bf) for _ in self.layers]
        self.pages = torch.randperm(pages, device=dev).to(torch.int32)  # no sequence is contiguous
        half = batch // 2
        self.wrappers = {
            "full": self._wrapper(flashinfer, 0, batch),
            0: self._wrapper(flashinfer, 0, half),
            1: self._wrapper(flashinfer, half, batch),
        }
        self.x = torch.randn(batch, h, device=dev, dtype=bf)
        self.micro = [self.x[:half].clone(), self.x[half:].clone()]

    def _wrapper(self, flashinfer: Any, lo: int, hi: int) -> Any:
        dev = torch.device("cuda")
        n = hi - lo
        per_seq = self.pages_per_seq
        indptr = torch.arange(0, n + 1, dtype=torch.int32, device=dev) * per_seq
        indices = self.pages[lo * per_seq : hi * per_seq].contiguous()
        last_len = self.context - (per_seq - 1) * self.page_size
        last = torch.full((n,), last_len, dtype=torch.int32, device=dev)
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            backend="fa2",
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last,
        )
        wrapper.plan(
            indptr.cpu(), indices, last.cpu(), self.hq, self.hkv, self.d, self.page_size,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip
        return wrapper

    def attend(self, layer: int, x: torch.Tensor, part: int | str) -> torch.Tensor:
        """QKV GEMM and paged attention of one layer."""
        qkv = x @ self.layers[layer]["qkv"].t()
        q = qkv[:, : self.hq * self.d].reshape(-1, self.hq, self.d)
        out = self.wrappers[part].run(q, (self.k[layer], self.v[layer]))
        return out.reshape(-1, self.hq * self.d)

    def mlp(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output GEMM and MLP of one layer, with the residual adds."""
        w = self.layers[layer]
        x = x + attn @ w["o"].t()
        gate_up = x @ w["gate_up"].t()
        return x + (F.silu(gate_up[:, : self.i]) * gate_up[:, self.i :]) @ w["down"].t()

    def gemms(self) -> None:
        x = self.x
        for layer, w in enumerate(self.layers):
            qkv = x @ w["qkv"].t()
            x = self.mlp(layer, x, qkv[:, : self.hq * self.d])
        x @ self.lm_head.t()

    def attention(self) -> None:
        q = torch.randn(self.batch, self.hq, self.d, device=self.x.device, dtype=self.x.dtype)
        for layer in range(len(self.layers)):
            self.wrappers["full"].run(q, (self.k[layer], self.v[layer]))

    def serial(self) -> None:
        x = self.x
        for layer in range(len(self.layers)):
            x = self.mlp(layer, x, self.attend(layer, x, "full"))
        x @ self.lm_head.t()

    def serial_micro(self) -> None:
        xs = list(self.micro)
        for layer in range(len(self.layers)):
            for m in (0, 1):
                xs[m] = self.mlp(layer, xs[m], self.attend(layer, xs[m], m))
        torch.cat(xs) @ self.lm_head.t()

    def overlapped(
        self, attn_stream: torch.cuda.Stream, gemm_stream: torch.cuda.Stream
    ) -> Callable[[], None]:
        """Per layer two phases: micro-batch 1 attends while 0 runs its MLP, then 0 attends (next layer) while 1
        runs its MLP. Events keep the phases in lockstep and carry the data dependencies across streams."""

        def run() -> None:
            main = torch.cuda.current_stream()
            attn_stream.wait_stream(main)
            gemm_stream.wait_stream(main)
            xs, attn = list(self.micro), [torch.empty(0), torch.empty(0)]
            with torch.cuda.stream(attn_stream):
                attn[0] = self.attend(0, xs[0], 0)
            num_layers = len(self.layers)
            for layer in range(num_layers):
                gemm_stream.wait_stream(attn_stream)
                with torch.cuda.stream(attn_stream):
                    attn[1] = self.attend(layer, xs[1], 1)
                with torch.cuda.stream(gemm_stream):
                    xs[0] = self.mlp(layer, xs[0], attn[0])
                attn_stream.wait_stream(gemm_stream)
                gemm_stream.wait_stream(attn_stream)
                with torch.cuda.stream(attn_stream):
                    if layer + 1 < num_layers:
                        attn[0] = self.attend(layer + 1, xs[0], 0)
                with torch.cuda.stream(gemm_stream):
                    xs[1] = self.mlp(layer, xs[1], attn[1])
                attn_stream.wait_stream(gemm_stream)
            main.wait_stream(attn_stream)
            main.wait_stream(gemm_stream)
            torch.cat(xs) @ self.lm_head.t()

        return run


def in_stream(stream: torch.cuda.Stream, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
        main.wait_stream(stream)

    return run


def carved_graph_ms(fn: Callable[[], None], carveout: int, iters: int) -> float:
    """`graph_ms` with cuBLASLt GEMMs captured under an SM carveout (the count is fixed at capture)."""
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if set_carveout is None:
        raise RuntimeError("this torch has no SM carveout for cuBLASLt")
    library = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # cuBLAS' own GEMMs take no SM target
    set_carveout(carveout)
    try:
        return graph_ms(fn, iters)
    finally:
        set_carveout(None)
        torch.backends.cuda.preferred_blas_library(library)


def main(argv: list[str]) -> int:
    a = parse(argv)
    if not torch.cuda.is_available():
        print("miles bench layers times GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    step = DecodeStep(a.model, a.batch, a.context, a.page_size)
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))
    kv_bytes = 2 * a.batch * a.context * step.hkv * step.d * 2 * len(step.layers)
    roofline_ms = 1e3 * (decode_weight_bytes(step.args, torch.bfloat16, a.batch) + kv_bytes) / bandwidth
    variants: dict[str, Callable[[], None]] = {
        "gemms": step.gemms,
        "attention": step.attention,
        "serial": step.serial,
        "serial-2mb": step.serial_micro,
        "overlap-2mb": step.overlapped(torch.cuda.Stream(), torch.cuda.Stream()),
    }
    contexts = []  # a green context destroyed with its Python object takes its streams with it
    for n in filter(None, a.green_sms.split(",")):
        try:
            from torch.cuda.green_contexts import GreenContext

            sms = torch.cuda.get_device_properties(0).multi_processor_count
            attn_ctx = GreenContext.create(num_sms=int(n), device_id=0)
            gemm_ctx = GreenContext.create(num_sms=sms - int(n), device_id=0)
            contexts += [attn_ctx, gemm_ctx]
            variants[f"green-{n}"] = step.overlapped(attn_ctx.Stream(), gemm_ctx.Stream())
            variants[f"attention-green-{n}"] = in_stream(attn_ctx.Stream(), step.attention)
            variants[f"overlap-gemm-green-{n}"] = step.overlapped(torch.cuda.Stream(), gemm_ctx.Stream())
        except Exception as err:  # torch or driver without green contexts: say so, time the rest
            print(f"green contexts unavailable: {type(err).__name__}: {err}", file=sys.stderr)
            break
    carved = {}
    for n in filter(None, a.carveout.split(",")):
        carved[f"gemms-carve-{n}"] = (int(n), step.gemms)
        carved[f"overlap-carve-{n}"] = (int(n), step.overlapped(torch.cuda.Stream(), torch.cuda.Stream()))
    results: dict[str, Any] = {}
    for name, fn in variants.items():
        try:
            results[name] = graph_ms(fn, a.iters)
        except Exception as err:
            results[name] = f"{type(err).__name__}: {err}"[:200]
    for name, (n, fn) in carved.items():
        try:
            results[name] = carved_graph_ms(fn, n, a.iters)
        except Exception as err:
            results[name] = f"{type(err).__name__}: {err}"[:200]
    report = {
        "model": a.model,
        "batch": a.batch,
        "context": a.context,
        "page_size": a.page_size,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "roofline_ms": roofline_ms,
        "ms": results,
        "serial_pct_of_roofline": 100 * roofline_ms / results["serial"]
        if isinstance(results["serial"], float)
        else None,
    }
    print(json.dumps(report), flush=True)
    print(f"{a.model}: batch {a.batch} x context {a.context}, copy {bandwidth / 1e12:.2f} TB/s")
    print(f"  {'bytes roofline':<14} {roofline_ms:8.2f} ms")
    for name, value in results.items():
        if isinstance(value, float):
            print(f"  {name:<14} {value:8.2f} ms  ({100 * roofline_ms / value:3.0f}% of roofline)")
        else:
            print(f"  {name:<14} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
