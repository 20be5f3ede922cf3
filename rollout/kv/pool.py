"""Paged KV storage, its page allocator, and the request table (request position -> KV slot).

Slots are token-granular indices into a flat [num_pages * page_size] view; pages are the allocation unit.
Page 0 is never handed out: padded rows (CUDA-graph buckets, deterministic chunks) write their keys there.
Graph padding rows skip the MoE experts, so what they write is arbitrary (possibly NaN): page 0 must never be
read for a real row, not even under a mask (0 * NaN is NaN). flashinfer reads only the pages it is given;
the torch backend, which gathers slot 0 as masked filler, never runs graphs.
The allocator keeps free pages in a device tensor and their count on the host, so allocating and freeing
never synchronise with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles.models.args import ModelArgs
from miles.rollout.kv.virtual_memory import VirtualRegion


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    routing_shape: tuple[int, int] | None
    """(num_moe_layers, top_k) when expert choices are stored per slot (MoE models recording routing)."""

    @classmethod
    def for_model(
        cls, args: ModelArgs, dtype: torch.dtype, page_size: int, record_routing: bool = False
    ) -> KVLayout:
        moe_layers = len(args.moe_layer_ids)
        routing = (moe_layers, args.num_experts_per_tok) if moe_layers and record_routing else None
        return cls(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, dtype, page_size, routing)

    @property
    def bytes_per_token(self) -> int:
        kv = (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )
        routing = self.routing_shape[0] * self.routing_shape[1] * 2 if self.routing_shape else 0  # int16 ids
        return kv + routing

    def pages_for_bytes(self, budget: int) -> int:
        return budget // (self.bytes_per_token * self.page_size)


class KVPool:
    """k/v caches as [num_layers, num_pages, page_size, num_kv_heads, head_dim] plus a page allocator."""

    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device, keep_addresses: bool = False
    ) -> None:
        """`keep_addresses` (CUDA): the storage lives in a reserved address range (virtual_memory.py), so a
        release and a re-allocation leave every tensor where it was and CUDA graphs over them stay valid."""
        if num_pages < 2:
            raise ValueError(
                f"the KV budget holds {num_pages} page(s) of {layout.page_size} tokens; the engine needs at least "
                "2 (one is reserved). Raise rollout.kv_cache_bytes (CPU) or rollout.kv_cache_fraction (GPU)."
            )
        self.layout, self.num_pages, self.device = layout, num_pages, device
        self.page_size = layout.page_size
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.routing: torch.Tensor | None = None
        self.region: VirtualRegion | None = None
        if keep_addresses:
            shapes = self._storage_shapes()
            self.region = VirtualRegion(VirtualRegion.bytes_for(shapes), device)
            self._hold([self.region.carve(dtype, shape) for dtype, shape in shapes])
        self._allocated = False
        self.allocate()

    # storage -----------------------------------------------------------------------------------
    def _storage_shapes(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        lay = self.layout
        kv = (lay.num_layers, self.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
        shapes = [(lay.dtype, kv), (lay.dtype, kv)]
        if lay.routing_shape is not None:
            shapes.append((torch.int16, (self.num_slots, *lay.routing_shape)))
        return shapes

    def _hold(self, storage: list[torch.Tensor]) -> None:
        """k, v and (when routing is recorded) the routing store, in `_storage_shapes()` order."""
        self.k_cache, self.v_cache, *routing = storage
        self.routing = routing[0] if routing else None

    def allocate(self) -> None:
        if self.region is not None:
            self.region.map()
            for t in (self.k_cache, self.v_cache, self.routing):
                if t is not None:
                    t.zero_()  # fresh mappings hold whatever the memory held last, NaN bit patterns included
        else:
            self._hold(
                [
                    torch.zeros(shape, dtype=dtype, device=self.device)
                    for dtype, shape in self._storage_shapes()
                ]
            )
        self._allocated = True
        lay = self.layout
        self._free = [torch.arange(1, self.num_pages, dtype=torch.int32, device=self.device)]
        self.num_free_pages = self.num_pages - 1
        # Per-layer views by slot, made once: every write and gather of a step would otherwise re-derive them.
        slots = (self.num_slots, lay.num_kv_heads, lay.head_dim)
        self._k_slots = [self.k_cache[i].view(slots) for i in range(lay.num_layers)]
        self._v_slots = [self.v_cache[i].view(slots) for i in range(lay.num_layers)]

    def release(self) -> None:
        """Give the storage's memory back (colocated training); `allocate()` brings it back empty. With
        `keep_addresses` the tensors stay, pointing at unmapped memory that nothing may touch until then."""
        if self.region is not None:
            self.region.unmap()
        else:
            self.k_cache = self.v_cache = self.routing = None
            self._k_slots, self._v_slots = [], []
        self._free = []
        self.num_free_pages = 0
        self._allocated = False

    @property
    def allocated(self) -> bool:
        return self._allocated

    @property
    def keeps_addresses(self) -> bool:
        return self.region is not None

    @property
    def bytes_outside_allocator(self) -> int:
        """Device memory the pool holds that torch's allocator does not count (its reserved region, mapped)."""
        return self.region.nbytes if self.region is not None and self.region.mapped else 0

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens that requests can hold (page 0 is reserved)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_token

    def k_layer(self, layer: int) -> torch.Tensor:
        return self.k_cache[layer]  # type: ignore[index]

    def v_layer(self, layer: int) -> torch.Tensor:
        return self.v_cache[layer]  # type: ignore[index]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [N, num_kv_heads, head_dim] (any strides) into `slots` [N]."""
        dtype = self.layout.dtype
        self._k_slots[layer].index_copy_(0, slots, k if k.dtype == dtype else k.to(dtype))
        self._v_slots[layer].index_copy_(0, slots, v if v.dtype == dtype else v.to(dtype))

    def gather(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v at `slots` (any shape S) -> [*S, num_kv_heads, head_dim], into `out` buffers when given."""
        lay = self.layout
        shape = (*slots.shape, lay.num_kv_heads, lay.head_dim)
        flat_slots = slots.reshape(-1)
        # index_select of whole slots (several times faster on CPU than advanced indexing); reusing the output
        # buffers across layers also saves the page faults of fresh multi-MB allocations.
        k_out = out[0].view(len(flat_slots), lay.num_kv_heads, lay.head_dim) if out is not None else None
        v_out = out[1].view(len(flat_slots), lay.num_kv_heads, lay.head_dim) if out is not None else None
        k = torch.index_select(self._k_slots[layer], 0, flat_slots, out=k_out)
        v = torch.index_select(self._v_slots[layer], 0, flat_slots, out=v_out)
        return k.view(shape), v.view(shape)

    # page allocator ----------------------------------------------------------------------------
    def alloc_pages(self, count: int) -> torch.Tensor:
        if count > self.num_free_pages:
            raise RuntimeError(
                f"KV pool: asked for {count} pages with {self.num_free_pages} free (scheduler bug)"
            )
        if len(self._free) > 1:
            self._free = [torch.cat(self._free)]
        free = self._free[0]
        pages, self._free[0] = free[:count], free[count:]
        self.num_free_pages -= count
        return pages

    def free_pages(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self._free.append(pages.to(torch.int32))
            self.num_free_pages += pages.numel()

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages holding `slots` (page-aligned: slots[0] starts a page, whole pages but the last)."""
        self.free_pages(slots[:: self.page_size] // self.page_size)

    @property
    def free_tokens(self) -> int:
        return self.num_free_pages * self.page_size


class RequestTable:
    """`table[row, pos]` is the KV slot of position `pos` of the request holding `row`."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.max_requests, self.max_context = max_requests, max_context
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.tenancy = np.zeros(max_requests, dtype=np.int64)
        """How many requests each row has been handed to: a row's next request gets a new number, so state
        kept per row between steps (attention/decode_staging.py) can tell its requests apart."""

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("request table full (scheduler bug)")
        row = self._free_rows.pop()
        self.tenancy[row] += 1
        return row

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free_rows)
