"""`ModelRunner`: one engine step's forward — the shared `CausalLM` over the paged KV cache.

Eager path: `forward_packed` with the chosen backend's attention context, then `compute_logits` on only
the rows that sample. Decode steps on CUDA replay a captured graph when one fits. Deterministic mode runs
the tokens in fixed-size chunks (every matmul has the same shape whatever the batch), attention row by row
and MoE experts in fixed blocks, so a request's logits do not depend on its batch.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from miles.models import fused
from miles.models.model import CausalLM
from miles.models.moe import Experts, RoutingTrace
from miles.rollout.attention import cpu_kernel
from miles.rollout.attention.decode_staging import DecodeStaging
from miles.rollout.attention.torch_backend import RowwiseAttention, TorchPagedAttention
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv.pool import KVPool, RequestTable

log = logging.getLogger(__name__)


FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""The head sizes flashinfer's paged prefill and decode kernels are built for."""


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str:
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if name == "auto":
        ok = (
            device.type == "cuda"
            and has_flashinfer
            and dtype in (torch.bfloat16, torch.float16)
            and head_dim in FLASHINFER_HEAD_DIMS
        )
        return "flashinfer" if ok else "torch"
    if name == "torch":
        return name
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(
                "rollout.backend=flashinfer needs a CUDA device; use rollout.backend=torch on CPU"
            )
        if not has_flashinfer:
            raise ImportError("rollout.backend=flashinfer needs flashinfer: pip install 'miles[gpu]'")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"flashinfer kernels run bf16/fp16 models, not {dtype}; use rollout.backend=torch"
            )
        if head_dim not in FLASHINFER_HEAD_DIMS:
            dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
            raise ValueError(
                f"flashinfer kernels are built for head_dim {dims}, not {head_dim}; use rollout.backend=torch"
            )
        return name
    raise ValueError(f"rollout.backend must be auto, torch or flashinfer, got {name!r}")


def use_fused_kernels(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """`rollout.fused_kernels` (auto | on | off) for a model on `device` in `dtype`."""
    if setting == "auto":  # compiling pays off for large low-precision models on a GPU
        return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return setting == "on"


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        table: RequestTable,
        backend: str,
        deterministic: bool,
        det_chunk_tokens: int,
        cuda_graph_max_batch: int,
        flashinfer_kernel: str = "fa2",
        fused_kernels: bool = False,
        piecewise_min_batch: int = 0,
        record_routing: bool = False,
        flashinfer_decode: str = "auto",
        verify_len: int = 0,
    ) -> None:
        self.model, self.pool, self.table = model, pool, table
        self.backend = backend
        self.deterministic, self.det_chunk_tokens = deterministic, det_chunk_tokens
        self.is_moe = bool(model.args.moe_layer_ids)
        self.record_routing = record_routing
        self.fused_kernels = fused_kernels
        self.flashinfer = None
        if backend == "flashinfer":
            from miles.rollout.attention.flashinfer_backend import FlashinferBackend

            self.flashinfer = FlashinferBackend(
                model.args, pool, table, model.dtype, flashinfer_kernel, flashinfer_decode
            )
        # CPU decode steps carry their gathered keys and values over to the next step (attention/decode_staging.py).
        cpu_torch = backend == "torch" and pool.device.type == "cpu" and not deterministic
        self.staging = DecodeStaging(pool) if cpu_torch else None
        args, lay = model.args, pool.layout
        q_per_kv = args.num_attention_heads // args.num_key_value_heads
        # Whether the C decode kernel has code for these decodes (cpu_kernel.py).
        self.cpu_kernel = cpu_torch and cpu_kernel.applies(lay.dtype, pool.device, q_per_kv, lay.head_dim)
        self.graphs = None
        self.last_hidden: torch.Tensor | None = None
        """[S, hidden] final-norm hidden states of the last forward's sampling rows (what a draft head reads;
        a CUDA graph's static buffer, valid until the next forward)."""
        if cuda_graph_max_batch > 0 and self.flashinfer is not None and not deterministic:
            from miles.rollout.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, cuda_graph_max_batch, piecewise_min_batch, verify_len)

    def context(self, batch: ForwardBatch):  # noqa: ANN201 - an AttentionContext
        if self.flashinfer is not None:
            return self.flashinfer.context(batch)
        return TorchPagedAttention(self.pool, self.table, batch, self.staging, self.cpu_kernel)

    def new_trace(self) -> RoutingTrace | None:
        """A MoE forward's trace: it records the experts chosen when routing is recorded, and carries the
        CUDA-graph batch's real rows either way."""
        return RoutingTrace(record=self.record_routing) if self.is_moe else None

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [S, V] of the sampling rows, routing [num_moe_layers, N, top_k] or None)."""
        with fused.fused_kernels(self.fused_kernels):
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.deterministic:
            return self._forward_deterministic(batch)
        if self.graphs is not None and self.graphs.fits(batch):
            try:
                logits, routing = self.graphs.replay(batch)
                self.last_hidden = self.graphs.last_hidden
                return logits, routing
            except torch.cuda.OutOfMemoryError as err:
                # Capture needs memory beside the KV pool; without it decode runs eagerly, slower but on.
                log.warning(
                    "CUDA-graph decode ran out of memory (%s); decoding without CUDA graphs from now on. "
                    "Lower rollout.kv_cache_fraction to keep them.",
                    str(err).split(". ")[0],
                )
                self.graphs.reset()
                self.graphs = None
            if self.model.device.type == "cuda":  # after the except: its traceback held the capture's tensors
                torch.cuda.empty_cache()
        out = self.model.forward_packed(
            batch.input_ids, batch.positions, self.context(batch), self.new_trace()
        )
        hidden = out.hidden if batch.every_token_samples else out.hidden[batch.sample_index]
        self.last_hidden = hidden
        return self.model.compute_logits(hidden), out.routing

    def release(self, keep_graphs: bool = False) -> None:
        """Forget what the KV pool's release invalidates: the per-row staging, and the CUDA graphs unless the
        pool comes back at the same addresses (`keep_graphs`); dropped graphs are re-captured on demand."""
        if self.graphs is not None and not keep_graphs:
            self.graphs.reset()
        if self.staging is not None:
            self.staging.clear()

    # deterministic mode --------------------------------------------------------------------------
    def _forward_deterministic(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunk = self.det_chunk_tokens
        rows, positions = batch.token_rows_positions()
        n = len(rows)
        pad = (-n) % chunk
        rows, positions = rows + [-1] * pad, positions + [0] * pad
        ids = F.pad(batch.input_ids, (0, pad))
        pos_t = F.pad(batch.positions, (0, pad))
        slots = F.pad(batch.out_slots, (0, pad))  # slot 0 is the reserved scratch page
        hidden, routing = [], []
        with _batch_invariant_experts(self.model, chunk):
            for s in range(0, n + pad, chunk):
                attn = RowwiseAttention(
                    self.pool, self.table, rows[s : s + chunk], positions[s : s + chunk], slots[s : s + chunk]
                )
                out = self.model.forward_packed(
                    ids[s : s + chunk], pos_t[s : s + chunk], attn, self.new_trace()
                )
                hidden.append(out.hidden)
                if out.routing is not None:
                    routing.append(out.routing)
        picked = self.last_hidden = torch.cat(hidden)[batch.sample_index]
        num = picked.shape[0]
        picked = F.pad(picked, (0, 0, 0, (-num) % chunk))
        logits = [self.model.compute_logits(picked[s : s + chunk]) for s in range(0, picked.shape[0], chunk)]
        routed = torch.cat(routing, dim=1)[:, :n] if routing else None
        return (torch.cat(logits)[:num] if logits else self.model.compute_logits(picked)), routed


@contextmanager
def _batch_invariant_experts(model: CausalLM, block: int) -> Iterator[None]:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    saved = [e.batch_invariant_block for e in experts]
    for e in experts:
        e.batch_invariant_block = block
    try:
        yield
    finally:
        for e, old in zip(experts, saved):
            e.batch_invariant_block = old
