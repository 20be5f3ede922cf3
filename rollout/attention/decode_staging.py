"""`DecodeStaging`: the torch backend's decode keys and values, kept from one step to the next (CPU).

Each decode step attends over every row's own suffix (its positions after a shared prefix) and over each
group's shared prefix. Gathered from the KV pool afresh, that is two row gathers per layer and step that
re-copy everything the previous step copied. When a step decodes the same rows as the step just before it,
held by the same requests (`RequestTable.tenancy`), in the same order, one token further, nothing the
previous step gathered has changed: a running request's slots are never rewritten, and a prefix's slots stay
locked while its requests run. Such a step only appends its new token's key and value per layer; any other
step (rows joined or left, a prefill, a verify chunk, a forward that failed half-way) gathers again. The
copies are laid out [rows, heads, positions, dim], the layout the CPU flash-attention kernel reads fastest.
The attention backend also keeps its last decode plan here (`order`), for the next step to reuse.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from miles.rollout.attention.cpu_kernel import whole_blocks
from miles.rollout.kv.pool import KVPool

_MIN_CAPACITY = 64
"""Positions per row allocated at least; the capacity doubles when a suffix outgrows it."""
MAX_BYTES = 256 * 2**20
"""Above this, staging is skipped (every step gathers), so a large CPU batch costs no second KV copy."""


class DecodeStaging:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.transposed_keys = False
        """The layout of the copies: chosen by each step that gathers, kept by the steps that append."""
        lay = pool.layout
        self.num_layers, self.heads, self.dim, self.dtype = (
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.dtype,
        )
        self.clear()

    def clear(self) -> None:
        """Forget everything: the next step gathers."""
        self.rows: np.ndarray | None = None
        self.tenancy: np.ndarray | None = None
        self.first: np.ndarray | None = None
        self.lengths: np.ndarray | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.prefix_slots: torch.Tensor | None = None
        self.prefix_keys: list[torch.Tensor] = []
        self.prefix_values: list[torch.Tensor] = []
        self.completed = False
        """Whether the last step went through every layer (a failed forward leaves stale layers)."""
        self.appending = self.uniform = False
        self._prefix_fresh = True
        self.order: Any = None
        """The attention backend's plan of the last decode-only step, for the next to reuse (attention_torch)."""

    # per step ------------------------------------------------------------------------------------
    def begin(
        self,
        rows: np.ndarray,
        tenancy: np.ndarray,
        first: np.ndarray,
        lengths: np.ndarray,
        transposed_keys: bool = False,
    ) -> bool:
        """Start a decode step over `rows` (table rows in decode order, held by their `tenancy`-th requests)
        with own-suffix `lengths` after `first` shared positions, its keys staged transposed or not. Returns
        whether this step can stage at all; then `suffix` and `prefix` serve it, and `layer_done` marks each
        layer finished."""
        width = int(lengths.max())
        extends = (
            self.completed
            and transposed_keys == self.transposed_keys
            and self.rows is not None
            and np.array_equal(rows, self.rows)
            # A row freed and handed to another request whose length happens to follow on is a new request.
            and np.array_equal(tenancy, self.tenancy)  # type: ignore[arg-type]
            and np.array_equal(first, self.first)  # type: ignore[arg-type]
            and np.array_equal(lengths, self.lengths + 1)  # type: ignore[operator]
            and width <= self.capacity
        )
        self.completed = False
        if not extends:
            capacity = self._capacity_for(width)
            if self._bytes(len(rows), capacity) > MAX_BYTES:
                self.clear()
                return False
            self.rows, self.tenancy, self.first = rows, tenancy, first
            self.keys, self.values = [], []
            self.transposed_keys = transposed_keys
        self.lengths = lengths
        self.appending = extends
        self.uniform = bool((lengths == width).all())
        return True

    @property
    def capacity(self) -> int:
        """Positions staged per row (0 before the first step)."""
        if not self.values:
            return 0
        return self.values[0].shape[2]

    def _capacity_for(self, width: int) -> int:
        return whole_blocks(max(_MIN_CAPACITY, 2 * width))

    def _bytes(self, rows: int, capacity: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * rows * self.heads * capacity * self.dim * elem

    def suffix(
        self, layer: int, slots: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, heads, width, dim] keys and values of the rows' own suffixes for `layer`, whose new
        tokens (`new_k`/`new_v` [rows, heads, dim], in decode order) the pool already holds; `slots`
        [width, rows] are their pool slots, read only when the step gathers."""
        assert self.lengths is not None
        width = int(self.lengths.max())
        if self.appending:
            keys, values = self.keys[layer], self.values[layer]
            key_at = keys.mT if self.transposed_keys else keys  # [rows, heads, positions, dim] either way
            if self.uniform:
                key_at[:, :, width - 1].copy_(new_k)
                values[:, :, width - 1].copy_(new_v)
            else:
                rows = torch.arange(len(self.lengths))
                cols = torch.from_numpy(self.lengths - 1)
                key_at[rows, :, cols] = new_k
                values[rows, :, cols] = new_v
        else:
            shape = (len(self.lengths), self.heads, self._capacity_for(width), self.dim)
            # Zeros, not empty: positions past a shorter row's suffix are masked, and 0 * NaN would not be.
            values = torch.zeros(shape, dtype=self.dtype, device=self.pool.device)
            keys = self._new_keys(shape)
            k, v = self.pool.gather(layer, slots)  # [width, rows, heads, dim]
            self._key_view(keys, width).copy_(k.permute(1, 2, 0, 3))
            values[:, :, :width].copy_(v.permute(1, 2, 0, 3))
            self.keys.append(keys)
            self.values.append(values)
        return self._key_view(self.keys[layer], width), self.values[layer][:, :, :width]

    def _new_keys(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Zeroed keys for `shape` [count, heads, positions, dim], in this staging's layout."""
        if self.transposed_keys:
            shape = (shape[0], shape[1], shape[3], shape[2])
        return torch.zeros(shape, dtype=self.dtype, device=self.pool.device)

    def _key_view(self, keys: torch.Tensor, width: int) -> torch.Tensor:
        """The first `width` positions of staged keys, as [count, heads, positions, dim]."""
        return keys[..., :width].mT if self.transposed_keys else keys[:, :, :width]

    def layer_done(self, layer: int) -> None:
        """`layer` attended with everything staged; after the last one the step's copies are complete."""
        if layer == self.num_layers - 1:
            self.completed = True

    def no_prefix(self) -> None:
        """This step has no shared prefixes: the next one that has gathers its own."""
        self.prefix_slots = None

    def prefix(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[groups, heads, P, dim] keys and values of the groups' shared prefixes at `slots` [groups, P]."""
        if layer == 0:
            # The same prefix slots as the step before (which also staged) still hold the same keys.
            regather = (
                not self.appending
                or self.prefix_slots is None
                or self.prefix_slots.shape != slots.shape
                or not torch.equal(self.prefix_slots, slots)
            )
            if regather:
                self.prefix_slots, self.prefix_keys, self.prefix_values = slots, [], []
            self._prefix_fresh = regather
        width = slots.shape[1]
        if self._prefix_fresh:
            k, v = self.pool.gather(layer, slots)  # [groups, P, heads, dim]
            if self.transposed_keys:
                keys = self._new_keys((len(slots), self.heads, whole_blocks(width), self.dim))
                self._key_view(keys, width).copy_(k.transpose(1, 2))
            else:
                keys = k.transpose(1, 2).contiguous()
            self.prefix_keys.append(keys)
            self.prefix_values.append(v.transpose(1, 2).contiguous())
        return self._key_view(self.prefix_keys[layer], width), self.prefix_values[layer]
