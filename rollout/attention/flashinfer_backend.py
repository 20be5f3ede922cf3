"""The `flashinfer` attention backend (GPU): paged prefill/decode kernels over the KV pool.

One wrapper is planned per step (page table, lengths) and shared by every layer of the forward. Eager steps
(prefill chunks mixed with decodes) use `BatchPrefillWithPagedKVCacheWrapper` with a causal mask aligned to
each sequence's end; CUDA-graph decode uses `BatchDecodeWithPagedKVCacheWrapper`, re-planned before each
replay. Its tensor-core path runs the fa2 prefill kernel (one JIT build with prefill); its CUDA-core path is
flashinfer's own decode kernel, which reads the KV faster where few query heads share a KV head
(`decode_uses_tensor_cores`).
"""

from __future__ import annotations

import numpy as np
import torch

from miles.models.args import ModelArgs
from miles.models.attention import KVWrite
from miles.rollout.forward_batch import ForwardBatch, concat_ranges, host_to_device
from miles.rollout.kv.pool import KVPool, RequestTable

_WORKSPACE_BYTES = 1024 * 1024 * 1024
"""flashinfer's split-KV scratch; graph decode at batch 1024 (32 heads x 128) needs ~335 MB."""

DECODE_KERNELS = ("auto", "tensor-cores", "cuda-cores")

_TENSOR_CORES_FROM_GROUP = 4
"""Query heads per KV head from which `auto` decodes on tensor cores. Below it the tensor-core kernel's
16-row MMA tiles are mostly padding, and the CUDA-core kernel read the KV up to 1.7x faster
(docs/benchmarks.md, "Decode attention kernels alone")."""


def check_decode_kernel(choice: str) -> None:
    if choice not in DECODE_KERNELS:
        raise ValueError(
            f"rollout.flashinfer_decode must be one of {', '.join(DECODE_KERNELS)}, got {choice!r}"
        )


def decode_uses_tensor_cores(choice: str, kernel: str, q_per_kv: int) -> bool:
    """Whether decode attention runs on flashinfer's tensor-core path (`rollout.flashinfer_decode`)."""
    check_decode_kernel(choice)
    if choice == "cuda-cores" and kernel == "fa3":
        raise ValueError(
            "rollout.flashinfer_decode=cuda-cores runs flashinfer's decode kernel, which has no fa3 form: "
            "use rollout.flashinfer_kernel=fa2 with it, or flashinfer_decode=auto"
        )
    if choice == "auto":
        return kernel == "fa3" or q_per_kv >= _TENSOR_CORES_FROM_GROUP
    return choice == "tensor-cores"


def paged_kv_metadata(
    table: RequestTable, rows: list[int], kv_lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1] int32 host, page indices [total] int32 device, last page length [B] int32 host)."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    # Where each page's first slot sits in the flattened table, worked out on the host: one copy and one
    # gather on the device, where the per-sequence arithmetic there took ~10 small launches a step.
    first_slots = concat_ranges(np.asarray(rows, dtype=np.int64) * table.max_context, pages, step=page_size)
    slots = table.table.view(-1)[host_to_device(first_slots, table.table.device)]
    indices = slots if page_size == 1 else slots // page_size  # int32 either way
    last = (lens - (pages - 1) * page_size).astype(np.int32)
    return torch.from_numpy(indptr), indices, torch.from_numpy(last)


class FlashinferAttention:
    def __init__(self, pool: KVPool, wrapper: object, out_slots: torch.Tensor) -> None:
        self.pool, self.wrapper, self.out_slots = pool, wrapper, out_slots

    def kv_write(self, layer_idx: int) -> KVWrite:
        return KVWrite(self.pool.k_layer(layer_idx), self.pool.v_layer(layer_idx), self.out_slots)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        if k is not None and v is not None:  # else the q/k kernel wrote them (`kv_write`)
            self.pool.write(layer_idx, self.out_slots, k, v)
        cache = (self.pool.k_layer(layer_idx), self.pool.v_layer(layer_idx))
        # q is a view into the [N, Hq + Hk, D] q/k buffer: the kernels take row and head strides, no copy.
        q = q if q.stride(-1) == 1 else q.contiguous()
        return self.wrapper.run(q, cache)  # type: ignore[attr-defined]


class FlashinferBackend:
    def __init__(
        self,
        args: ModelArgs,
        pool: KVPool,
        table: RequestTable,
        dtype: torch.dtype,
        kernel: str = "fa2",
        decode: str = "auto",
    ) -> None:
        import flashinfer

        if kernel not in ("fa2", "fa3"):
            raise ValueError(f"rollout.flashinfer_kernel must be fa2 or fa3, got {kernel!r}")
        self.kernel = kernel
        q_per_kv = args.num_attention_heads // args.num_key_value_heads
        self.decode_tensor_cores = decode_uses_tensor_cores(decode, kernel, q_per_kv)

        self.flashinfer = flashinfer
        self.pool, self.table, self.dtype = pool, table, dtype
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = float(args.head_dim) ** -0.5  # type: ignore[operator]
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=kernel)
        self._plan_copied: torch.cuda.Event | None = None

    def plan(
        self,
        wrapper: object,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        *,
        qo_indptr: torch.Tensor | None = None,
        **extra: object,
    ) -> None:
        """Plan a prefill (with `qo_indptr`) or decode wrapper over the pool's pages for this step.

        `plan` fills the wrapper's pinned host buffer and copies it to the device asynchronously. With overlap
        scheduling the previous plan's copy may still be queued behind the step in flight; wait for that copy
        (not for the step) before the buffer is written again.
        """
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        leading = () if qo_indptr is None else (qo_indptr,)
        wrapper.plan(  # type: ignore[attr-defined]
            *leading,
            indptr,
            indices,
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.pool.page_size,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.scale,
            **extra,
        )
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def context(self, batch: ForwardBatch) -> FlashinferAttention:
        qo_indptr = torch.from_numpy(np.asarray(batch.q_starts, dtype=np.int32))
        indptr, indices, last = paged_kv_metadata(self.table, batch.rows, batch.kv_lens, self.pool.page_size)
        self.plan(self.prefill, indptr, indices, last, qo_indptr=qo_indptr, causal=True)
        return FlashinferAttention(self.pool, self.prefill, batch.out_slots)

    def eager_decode_wrapper(self) -> object:
        """A decode wrapper for attention run outside a graph (piecewise graphs): its plan may split the KV
        or not, as the real batch needs."""
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend=self.kernel
        )

    def graph_decode_wrapper(
        self,
        batch_size: int,
        indptr_buf: torch.Tensor,
        indices_buf: torch.Tensor,
        last_buf: torch.Tensor,
        rows_per_request: int = 1,
    ) -> object:
        """A graph-mode decode wrapper over the static page-table buffers. Verify steps (`rows_per_request`
        > 1, planned with `q_len_per_req`) take the tensor-core path whatever `decode_tensor_cores` says: it
        is the only one that takes several query rows per request."""
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores or rows_per_request > 1,
            backend=self.kernel,
            paged_kv_indptr_buffer=indptr_buf[: batch_size + 1],
            paged_kv_indices_buffer=indices_buf,
            paged_kv_last_page_len_buffer=last_buf[:batch_size],
        )
