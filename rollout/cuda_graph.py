"""CUDA-graph decode: the decode forward (embedding to logits) replayed for batch-size buckets.

Each bucket owns a flashinfer decode wrapper bound to static index buffers and a graph captured on static
input buffers (token ids, positions, KV slots). A decode step of B requests pads to the smallest bucket
>= B (padding rows read and write the reserved page 0), re-plans the wrapper with the real page table and
replays; the fused MoE kernels route the padding rows to no expert. Graphs point into the KV pool: a
release that keeps the pool's addresses (kv/virtual_memory.py) keeps them, any other drops them, and they are
captured again on first use.

Buckets of at least `piecewise_min_batch` rows are captured in pieces instead: one graph from the embedding
to the first layer's attention, one between each two attentions, one from the last to the logits. Replay
runs each layer's attention eagerly between the pieces, through a decode wrapper planned for the real rows
only. In graph mode flashinfer's scheduler must fix its split of the KV ahead of time, so it always splits
and always runs a merge kernel; planned eagerly, it splits only what a batch too small to fill the GPU
needs. The pieces cost two launches per layer of host time, which the long steps of a large batch hide
behind the GPU (overlap scheduling).

With speculative decoding, verify steps of up to `VERIFY_MAX_BATCH` requests are captured too: every
request feeds its last token and exactly `spec_draft_tokens` drafts (the engine pads shorter drafts), so a
step is `bucket x verify_len` rows with flashinfer's decode wrapper planned for `q_len_per_req =
verify_len` (causal within each request's rows; tensor-core path, the only one that takes several query
rows per request). Padding requests hold `verify_len` tokens on page 0. A verify graph's logits get a sampler
graph too: each row draws the token plain decoding would draw at its position.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.models.attention import KVWrite
from miles.rollout.attention.flashinfer_backend import FlashinferAttention, paged_kv_metadata
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv.pool import KVPool
from miles.rollout.sampling.graph import SamplerGraphs, plain_draw
from miles.rollout.sampling.sampler import SamplingTensors

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

VERIFY_FLASHINFER = (0, 6, 18)
"""The flashinfer release the verify graphs were tested on (0.6.18.post1, docs/benchmarks.md). Multi-row
decode plans (`q_len_per_req`) on the fa2 path gave wrong rows silently not long before it; with an older
release verify steps run eagerly."""

VERIFY_MAX_BATCH = 64
"""Largest batch whose verify steps replay a graph. Speculation pays where a decode step is bound by reading
the weights or by launches, which is small batches; the engine drafts nothing for larger ones, whose
verify steps would run eagerly (~25 ms of host work per step for a 28-layer model on the H200's host)."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: object
    logits: torch.Tensor
    routing: torch.Tensor | None
    hidden: torch.Tensor
    """The final-norm hidden states the logits come from (a draft head reads them: spec/head.py)."""


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]
    """num_layers + 1 graphs; each layer's attention runs between graphs i and i + 1."""
    query: torch.Tensor
    """[bucket, Hq, D]: the static q each graph but the last leaves for its layer's attention."""
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer: the pool's (k, v) pages."""
    logits: torch.Tensor
    routing: torch.Tensor | None
    hidden: torch.Tensor


class _SplitAtAttention:
    """The attention context of a piecewise capture: each layer's attention ends the graph being captured and
    begins the next one. The KV write stays in the graph; the attention output is a static buffer that the
    eager attention fills at replay."""

    def __init__(
        self,
        pool: KVPool,
        slots: torch.Tensor,
        qk_out: torch.Tensor,
        attn_out: torch.Tensor,
        mempool: tuple[int, int],
    ) -> None:
        self.pool, self.slots, self.mempool = pool, slots, mempool
        self.qk_out, self.attn_out = qk_out, attn_out
        self.query = qk_out[:, : attn_out.shape[1]]
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.mempool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def kv_write(self, layer_idx: int) -> KVWrite:
        # The q/k kernel writes q/k into one static buffer: a q per layer and bucket kept alive between
        # the pieces instead would hold ~0.45 MB per row of a bucket on the 30B-A3B shape.
        k, v = self.pool.k_layer(layer_idx), self.pool.v_layer(layer_idx)
        return KVWrite(k, v, self.slots, out=self.qk_out)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        if k is not None and v is not None:
            self.pool.write(layer_idx, self.slots, k, v)
        if q.data_ptr() != self.query.data_ptr() or q.stride() != self.query.stride():
            self.query.copy_(q)  # q came from elsewhere than the q/k kernel (fused kernels off, no q/k norm)
        self.end()
        self.begin()
        return self.attn_out


class CudaGraphRunner:
    def __init__(
        self, runner: ModelRunner, max_batch: int, piecewise_min_batch: int = 0, verify_len: int = 0
    ) -> None:
        # Graph padding rows may write NaN to page 0, which only the flashinfer kernels never read (kv/pool.py).
        assert runner.backend == "flashinfer", "CUDA-graph decode runs on the flashinfer backend only"
        # The runner owns this object: a reference back would make a cycle that only the cycle collector
        # frees, KV pool included, at a moment of its choosing (possibly during another engine's capture).
        self._runner = weakref.ref(runner)
        self.max_batch = max_batch
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [max_batch]
        self.piecewise_min_batch = piecewise_min_batch
        self.graphs: dict[int, _Graph] = {}
        self.pieces: dict[int, _Pieces] = {}
        # flashinfer takes several query rows per request in a decode plan on its fa2 kernels only, and
        # `verified_flashinfer` is the version the verify graphs were tested with.
        fa2 = runner.flashinfer is not None and runner.flashinfer.kernel == "fa2"
        self.verify_len = verify_len if verify_len > 1 and fa2 and verified_flashinfer() else 0
        """Rows per request of a verify step (1 + draft tokens); 0 without speculative decoding (or on fa3,
        where verify steps run eagerly)."""
        self.verify_buckets = [b for b in self.buckets if b <= VERIFY_MAX_BATCH] if self.verify_len else []
        self.verify: dict[int, _Graph] = {}
        self.sampler = SamplerGraphs(runner.pool.device)
        self.last_logits: torch.Tensor | None = None
        """The static logits buffer of the last replay, [bucket, V]."""
        self.last_hidden: torch.Tensor | None = None
        """The real rows of the last replay's static hidden-state buffer."""

    @property
    def verify_max_batch(self) -> int:
        """Largest batch whose verify steps replay a graph (0: none do)."""
        return self.verify_buckets[-1] if self.verify_buckets else 0

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether a graph replays `batch`: a decode step within the buckets, or a verify step of
        `verify_len` rows per request within the verify buckets."""
        if batch.verify_len:
            return batch.verify_len == self.verify_len and batch.batch_size <= self.verify_max_batch
        return batch.is_decode and batch.batch_size <= self.max_batch

    @property
    def runner(self) -> ModelRunner:
        runner = self._runner()
        assert runner is not None, "the model runner owning these graphs is gone"
        return runner

    def reset(self) -> None:
        self.graphs.clear()
        self.pieces.clear()
        self.verify.clear()
        self.sampler.reset()
        self.last_logits = self.last_hidden = None

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sampler graph's draw where `logits` are the last replay's and every row takes the plain draw
        (sampling/graph.py); None otherwise (the caller samples eagerly)."""
        full = self.last_logits
        if full is None or logits.data_ptr() != full.data_ptr() or not plain_draw(st, logits.device):
            return None
        return self.sampler.sample(full, logits.shape[0], st)

    def _piecewise(self, bucket: int) -> bool:
        return 0 < self.piecewise_min_batch <= bucket

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
        # One capture stream for every bucket: the allocator reuses a freed block only on the stream it was
        # allocated on, so buckets captured on separate streams could not share their activations' memory.
        self.capture_stream = torch.cuda.Stream(device)
        if any(self._piecewise(b) for b in self.buckets):
            heads, kv_heads, dim = (
                model.args.num_attention_heads,
                model.args.num_key_value_heads,
                model.args.head_dim,
            )
            self.qk_out = torch.zeros(n, heads + kv_heads, dim, dtype=model.dtype, device=device)
            self.attn_out = torch.zeros(n, heads, dim, dtype=model.dtype, device=device)
            self.eager_wrapper = backend.eager_decode_wrapper()
        for bs in sorted(self.buckets, reverse=True):  # largest first: the smaller ones reuse its memory
            if self._piecewise(bs):
                self.pieces[bs] = self._capture_pieces(bs, mempool)
                self.sampler.capture(self.pieces[bs].logits, mempool, self.capture_stream)
                continue
            wrapper = backend.graph_decode_wrapper(bs, self.indptr_buf, self.indices_buf, self.last_buf)
            attn = FlashinferAttention(pool, wrapper, self.slots[:bs])
            self._warm_up(bs, attn)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=self.capture_stream):
                logits, routing, hidden = self._forward(attn, self.ids[:bs], self.positions[:bs])
            self.graphs[bs] = _Graph(graph, wrapper, logits, routing, hidden)
            self.sampler.capture(logits, mempool, self.capture_stream)
        if self.verify_buckets:
            self._capture_verify(mempool)
        torch.cuda.synchronize(device)

    def _capture_verify(self, mempool: tuple[int, int]) -> None:
        backend, pool = self.runner.flashinfer, self.runner.pool
        assert backend is not None
        rows = self.verify_max_batch * self.verify_len
        self.v_ids = torch.zeros(rows, dtype=torch.long, device=pool.device)
        self.v_positions = torch.zeros(rows, dtype=torch.long, device=pool.device)
        self.v_slots = torch.zeros(rows, dtype=torch.long, device=pool.device)
        for bs in sorted(self.verify_buckets, reverse=True):
            n = bs * self.verify_len
            wrapper = backend.graph_decode_wrapper(
                bs, self.indptr_buf, self.indices_buf, self.last_buf, self.verify_len
            )
            attn = FlashinferAttention(pool, wrapper, self.v_slots[:n])
            self._warm_up(bs, attn, self.verify_len)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=self.capture_stream):
                logits, routing, hidden = self._forward(attn, self.v_ids[:n], self.v_positions[:n])
            self.verify[bs] = _Graph(graph, wrapper, logits, routing, hidden)
            self.sampler.capture(logits, mempool, self.capture_stream)

    def _capture_pieces(self, bs: int, mempool: tuple[int, int]) -> _Pieces:
        pool, model = self.runner.pool, self.runner.model
        self._warm_up(bs, FlashinferAttention(pool, self.eager_wrapper, self.slots[:bs]))
        torch.cuda.empty_cache()  # the warm-up's cached blocks back to the device, for the graphs' pool
        split = _SplitAtAttention(pool, self.slots[:bs], self.qk_out[:bs], self.attn_out[:bs], mempool)
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(stream):
            split.begin()
            try:
                logits, routing, hidden = self._forward(split, self.ids[:bs], self.positions[:bs])
                split.end()  # the last piece: from the last attention to the logits
            except BaseException:
                if torch.cuda.is_current_stream_capturing():  # leave the stream usable, keep the first error
                    try:
                        split.end()
                    except RuntimeError:
                        pass  # an invalidated capture cannot end cleanly
                raise
        torch.cuda.current_stream(pool.device).wait_stream(stream)
        num_layers = model.args.num_hidden_layers
        assert len(split.graphs) == num_layers + 1, "a layer did not attend exactly once"
        caches = [(pool.k_layer(i), pool.v_layer(i)) for i in range(num_layers)]
        return _Pieces(split.graphs, split.query, caches, logits, routing, hidden)

    def _forward(
        self, attn: FlashinferAttention | _SplitAtAttention, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        runner = self.runner
        trace = runner.new_trace()
        if trace is not None:
            trace.valid_rows = self.valid_rows
        out = runner.model.forward_packed(ids, positions, attn, trace)
        return runner.model.compute_logits(out.hidden), out.routing, out.hidden

    def _warm_up(self, bs: int, attn: FlashinferAttention, q_len: int = 1) -> None:
        """Two eager forwards on a side stream (compiles, autotunes, allocates) before a capture, attention
        planned over bs requests of q_len new tokens, each holding q_len tokens on page 0."""
        device, page = self.runner.pool.device, self.runner.pool.page_size
        indptr, indices, last = _padding_requests(torch.zeros(1, dtype=torch.int32), bs, q_len, page, device)
        extra = {"q_len_per_req": q_len} if q_len > 1 else {}
        self.runner.flashinfer.plan(attn.wrapper, indptr, indices, last, **extra)  # type: ignore[union-attr]
        rows = bs * q_len
        self.valid_rows.fill_(rows)
        ids, positions = (self.ids, self.positions) if q_len == 1 else (self.v_ids, self.v_positions)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(attn, ids[:rows], positions[:rows])
            self._forward(attn, ids[:rows], positions[:rows])
        torch.cuda.current_stream(device).wait_stream(side)

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.graphs and not self.pieces:
            self.capture()
        if batch.verify_len:
            return self._replay_verify(batch)
        real = batch.batch_size
        bs = self._bucket(real)
        self._fill_inputs(batch, bs, self.ids, self.positions, self.slots)
        if bs in self.pieces:
            return self._replay_pieces(batch, self.pieces[bs])
        entry = self.graphs[bs]
        indptr, indices, last = self._page_table(batch, bs, 1)
        self.runner.flashinfer.plan(entry.wrapper, indptr, indices, last)  # type: ignore[union-attr]
        entry.graph.replay()
        self.last_logits, self.last_hidden = entry.logits, entry.hidden[:real]
        routing = entry.routing[:, :real] if entry.routing is not None else None
        return entry.logits[:real], routing

    def _replay_verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        length, real = self.verify_len, batch.batch_size
        bs = next(b for b in self.verify_buckets if b >= real)
        entry = self.verify[bs]
        rows = real * length
        self._fill_inputs(batch, bs * length, self.v_ids, self.v_positions, self.v_slots)
        indptr, indices, last = self._page_table(batch, bs, length)
        self.runner.flashinfer.plan(entry.wrapper, indptr, indices, last, q_len_per_req=length)  # type: ignore[union-attr]
        entry.graph.replay()
        self.last_logits, self.last_hidden = entry.logits, entry.hidden[:rows]
        routing = entry.routing[:, :rows] if entry.routing is not None else None
        return entry.logits[:rows], routing

    def _replay_pieces(
        self, batch: ForwardBatch, pieces: _Pieces
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        runner, real = self.runner, batch.batch_size
        assert runner.flashinfer is not None
        # Only the real rows attend: the padding rows keep a stale (finite) attention output.
        indptr, indices, last = paged_kv_metadata(
            runner.table, batch.rows, batch.kv_lens, runner.pool.page_size
        )
        runner.flashinfer.plan(self.eager_wrapper, indptr, indices, last)
        run, q, out = self.eager_wrapper.run, pieces.query[:real], self.attn_out[:real]  # type: ignore[attr-defined]
        for graph, cache in zip(pieces.graphs, pieces.caches):
            graph.replay()
            run(q, cache, out=out)
        pieces.graphs[-1].replay()
        self.last_logits, self.last_hidden = pieces.logits, pieces.hidden[:real]
        routing = pieces.routing[:, :real] if pieces.routing is not None else None
        return pieces.logits[:real], routing

    def _fill_inputs(
        self, batch: ForwardBatch, n: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """The batch's tokens into a graph's static inputs of `n` rows; the padding rows after them take
        position 0 and write their keys and values to slot 0 (page 0)."""
        real = batch.input_ids.shape[0]
        ids[:real].copy_(batch.input_ids)
        positions[:real].copy_(batch.positions)
        slots[:real].copy_(batch.out_slots)
        self.valid_rows.fill_(real)
        if n > real:
            ids[real:n].zero_()
            positions[real:n].zero_()
            slots[real:n].zero_()

    def _page_table(
        self, batch: ForwardBatch, bs: int, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """flashinfer's page-table metadata for a graph of `bs` requests: the batch's, then padding requests
        holding `tokens` tokens each on page 0."""
        runner, real = self.runner, batch.batch_size
        page = runner.pool.page_size
        indptr, indices, last = paged_kv_metadata(runner.table, batch.rows, batch.kv_lens, page)
        if bs > real:
            indptr, indices, last = _padding_requests(
                indptr, bs - real, tokens, page, indices.device, indices, last
            )
        return indptr, indices, last


def verified_flashinfer(version: str | None = None) -> bool:
    """Whether the installed flashinfer (or `version`) is at least `VERIFY_FLASHINFER`."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("flashinfer-python")
        except PackageNotFoundError:
            return False
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= VERIFY_FLASHINFER


def _padding_requests(
    indptr: torch.Tensor,
    count: int,
    tokens: int,
    page_size: int,
    device: torch.device,
    indices: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The page-table metadata (host indptr, device indices, host last-page lengths) with `count` requests
    appended that hold `tokens` tokens each on page 0, which no real request reads."""
    pages = -(-tokens // page_size)
    tail = indptr[-1] + pages * torch.arange(1, count + 1, dtype=torch.int32)
    pad_last = torch.full((count,), tokens - (pages - 1) * page_size, dtype=torch.int32)
    pad_indices = torch.zeros(count * pages, dtype=torch.int32, device=device)
    return (
        torch.cat([indptr, tail]),
        pad_indices if indices is None else torch.cat([indices, pad_indices]),
        pad_last if last is None else torch.cat([last, pad_last]),
    )
