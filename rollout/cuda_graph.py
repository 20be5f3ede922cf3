"""CUDA-graph decode: the whole decode forward (embedding to logits) replayed for batch-size buckets.

Each bucket owns a flashinfer decode wrapper bound to static index buffers and a graph captured on static
input buffers (token ids, positions, KV slots). A decode step of B requests pads to the smallest bucket
>= B (padding rows read and write the reserved page 0), re-plans the wrapper with the real page table and
replays; the fused MoE kernels route the padding rows to no expert. Graphs point into the KV pool, so
they are dropped when the pool is released and re-captured on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.rollout.attention_flashinfer import FlashinferAttention, paged_kv_metadata
from miles.rollout.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from miles.rollout.model_runner import ModelRunner

_BUCKETS = [
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    *range(80, 257, 16),
    *range(288, 513, 32),
    *range(576, 1025, 64),
]
"""Graph batch sizes: fine steps keep padding (wasted rows) under ~12%."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: object
    logits: torch.Tensor
    routing: torch.Tensor | None


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        # Graph padding rows may write NaN to page 0, which only the flashinfer kernels never read (kv_pool.py).
        assert runner.backend == "flashinfer", "CUDA-graph decode runs on the flashinfer backend only"
        self.runner, self.max_batch = runner, max_batch
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, _Graph] = {}

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.batch_size <= self.max_batch

    def reset(self) -> None:
        self.graphs.clear()

    def _bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    @torch.no_grad()
    def capture(self) -> None:
        runner = self.runner
        backend, pool, model = runner.flashinfer, runner.pool, runner.model
        assert backend is not None
        device = pool.device
        n = self.max_batch
        pages_per_seq = -(-runner.table.max_context // pool.page_size)
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.indptr_buf = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.last_buf = torch.zeros(n, dtype=torch.int32, device=device)
        # Sequences can share pages (radix cache): a batch's page list is bounded per sequence only.
        self.indices_buf = torch.zeros(n * pages_per_seq, dtype=torch.int32, device=device)
        # The real rows of a replay; the fused MoE kernels skip the padding after them.
        self.valid_rows = torch.zeros(1, dtype=torch.int32, device=device)
        mempool = torch.cuda.graph_pool_handle()
        for bs in sorted(self.buckets, reverse=True):  # largest first: the smaller ones reuse its memory
            wrapper = backend.graph_decode_wrapper(bs, self.indptr_buf, self.indices_buf, self.last_buf)
            backend.plan(
                wrapper,
                torch.arange(bs + 1, dtype=torch.int32),
                torch.zeros(bs, dtype=torch.int32, device=device),
                torch.ones(bs, dtype=torch.int32),
            )
            attn = FlashinferAttention(pool, wrapper, self.slots[:bs])

            def forward(
                bs: int = bs, attn: FlashinferAttention = attn
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
                trace = runner.new_trace()
                if trace is not None:
                    trace.valid_rows = self.valid_rows
                out = model.forward_packed(self.ids[:bs], self.positions[:bs], attn, trace)
                return model.compute_logits(out.hidden), out.routing

            self.valid_rows.fill_(bs)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                forward()
                forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits, routing = forward()
            self.graphs[bs] = _Graph(graph, wrapper, logits, routing)
        torch.cuda.synchronize(device)

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.graphs:
            self.capture()
        real = batch.batch_size
        bs = self._bucket(real)
        entry = self.graphs[bs]
        self.ids[:real].copy_(batch.input_ids)
        self.positions[:real].copy_(batch.positions)
        self.slots[:real].copy_(batch.out_slots)
        self.valid_rows.fill_(real)
        if bs > real:
            self.ids[real:bs].zero_()
            self.positions[real:bs].zero_()
            self.slots[real:bs].zero_()
        indptr, indices, last = paged_kv_metadata(
            self.runner.table, batch.rows, batch.kv_lens, self.runner.pool.page_size
        )
        if bs > real:  # padding rows: one page each, page 0, holding one token
            pad = bs - real
            indptr = torch.cat([indptr, indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)])
            indices = torch.cat([indices, torch.zeros(pad, dtype=torch.int32, device=indices.device)])
            last = torch.from_numpy(np.concatenate([last.numpy(), np.ones(pad, dtype=np.int32)]))
        self.runner.flashinfer.plan(entry.wrapper, indptr, indices, last)  # type: ignore[union-attr]
        entry.graph.replay()
        routing = entry.routing[:, :real] if entry.routing is not None else None
        return entry.logits[:real], routing
