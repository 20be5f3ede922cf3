"""What the benchmarks share: device timing (`median_cuda_seconds`, `graph_ms`), the copy bandwidth the
rooflines divide by, and a decode step's weight bytes and FLOPs."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from miles.models import ModelArgs


def median_cuda_seconds(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Median device time of `fn` (CUDA events around each call), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    src = torch.randn(512 * 1024 * 1024, device=device, dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    seconds = median_cuda_seconds(copy, iters=10, warmup=2)
    del src, dst, copy
    torch.cuda.empty_cache()
    return 2 * 512 * 1024 * 1024 * 4 / seconds


def decode_weight_bytes(args: ModelArgs, dtype: torch.dtype, batch: float) -> float:
    """Weight bytes a decode step must read at this batch size (embedding rows aside; MoE: experts touched)."""
    elem = torch.empty((), dtype=dtype).element_size()
    h = args.hidden_size
    total = args.num_parameters() - args.vocab_size * h  # the embedding is gathered, not streamed
    if args.tie_word_embeddings:
        total += args.vocab_size * h  # ... but a tied lm_head reads it whole
    if args.num_experts:
        per_expert = 3 * h * args.moe_intermediate_size
        touched = args.num_experts * (1 - (1 - args.num_experts_per_tok / args.num_experts) ** batch)
        total -= len(args.moe_layer_ids) * per_expert * (args.num_experts - touched)
    return total * elem


def decode_flops_per_token(args: ModelArgs, context: float) -> float:
    """Matmul FLOPs of one decode token: active weights (MoE: top-k experts) plus attention over the context."""
    h = args.hidden_size
    params = (
        args.num_parameters() - args.vocab_size * h + (args.vocab_size * h if args.tie_word_embeddings else 0)
    )
    if args.num_experts:
        per_expert = 3 * h * args.moe_intermediate_size
        params -= len(args.moe_layer_ids) * per_expert * (args.num_experts - args.num_experts_per_tok)
    attention = 4 * context * args.num_attention_heads * args.head_dim * args.num_hidden_layers
    return 2 * params + attention


def graph_ms(fn: Callable[[], None], iters: int) -> float:
    """Median replay time of `fn` captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture stream (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * median_cuda_seconds(graph.replay, iters)
