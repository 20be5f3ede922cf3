"""The `torch` attention backend: readable paged attention over the KV pool, CPU and GPU.

`TorchPagedAttention` writes the step's new keys/values into their slots, then attends. Single-token
sequences (decodes) go together through one SDPA call; the query heads that share a KV head are folded
into the query dimension, so keys and values are never repeated for grouped-query attention. On CPU,
decodes whose requests share a cached prefix (the `n` samples of a group) attend to that prefix once per
group ("cascade" attention): prefix and own-suffix partial results are merged through their log-sum-exp.
Everything that indexing needs (decode order, KV slots, masks, gather buffers) is planned once per step,
so that a layer runs only gathers, two attention kernels and the merge. A float32 CPU step that stages its
decodes on one thread runs prefix and suffix of every decode row in one call of a C kernel instead
(cpu_kernel.py). Longer sequences (prefill chunks) go one at a time.

`RowwiseAttention` is the deterministic variant: every query row attends over exactly its own prefix in a
call of its own, so its result cannot depend on which other rows share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from miles.models.attention import sdpa
from miles.rollout.attention import cpu_kernel
from miles.rollout.attention.decode_staging import DecodeStaging
from miles.rollout.forward_batch import ForwardBatch, host_to_device
from miles.rollout.kv.pool import KVPool, RequestTable

_MIN_SHARED_PREFIX = 16
"""Shorter shared prefixes are not worth a separate attention call."""
_SHORT_EXTEND = 16
"""Multi-token chunks up to this long attend together in one padded call."""


def _flash_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention: q [B, H, Lq, D], k/v [B, H, Lk, D], additive `bias` broadcast over the scores
    -> (out [B, H, Lq, D], logsumexp of the scores [B, H, Lq] float32)."""
    # The op reads the head dimension as if contiguous (torch 2.13: a transposed view of the keys gives wrong
    # results, no error); the C kernel's transposed staged keys come here when it is off.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse.float()


def _step_mask(valid: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask as SDPA takes it; on CPU the additive form, built once per step instead of once per layer."""
    mask = host_to_device(valid, device)
    if device.type != "cpu":
        return mask
    return torch.zeros(valid.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one chunk, the last Tq of Tk positions: q [Tq, Hq, D], keys/values [Tk, Hkv, D]."""
    if q.device.type != "cpu":
        return sdpa(q, keys, values, scale, causal=True)
    # SDPA's grouped-query mode has only the unfused kernel on CPU: repeating the KV heads of one chunk costs
    # less, and lets the fused (flash) kernel run on [1, Hq, T, D].
    (tq, hq, _), (tk, hkv, _) = q.shape, keys.shape
    keys = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
    values = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
    mask = None if tq == tk else torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out[0].transpose(0, 1)


@dataclass
class _FreshRun:
    """Prefill chunks of whole sequences (nothing cached before them) of one length, adjacent in the step's
    tokens: they attend to their own new keys and values, in one call."""

    chunks: list[int]
    """Their batch indices."""
    start: int
    """First token row of the run."""
    count: int
    length: int


def _fresh_runs(batch: ForwardBatch, long: list[int], starts: list[int]) -> list[_FreshRun]:
    """The runs of equal-length whole-sequence chunks among the step's long chunks `long` (CPU: one SDPA call
    per run instead of a gather and a call per sequence; the kernel computes each sequence alike)."""
    runs: list[_FreshRun] = []
    for i in long:
        n = batch.q_lens[i]
        if batch.kv_lens[i] != n:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.length == n and last.start + last.count * n == starts[i]:
            last.chunks.append(i)
            last.count += 1
        else:
            runs.append(_FreshRun([i], starts[i], 1, n))
    return runs


def _fresh_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _FreshRun, scale: float
) -> torch.Tensor:
    """Causal attention of a run's sequences over their own keys: q [count * T, Hq, D], k/v [count * T,
    Hkv, D] -> [count * T, Hq, D]. The KV heads are repeated, as in `_prefill`, for the CPU's fused kernel."""
    (n, hq, d), hkv = q.shape, k.shape[1]
    shape = (run.count, run.length)
    qs = q.view(*shape, hq, d).transpose(1, 2)
    keys = k.view(*shape, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    values = v.view(*shape, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(n, hq, d)


def _table_slots(table: RequestTable, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
    """int64 KV slots `table[rows[i], cols[i, j]]`, indexed on the host and gathered in one call."""
    flat = torch.from_numpy(rows[:, None] * table.max_context + cols).to(table.table.device)
    return table.table.view(-1).index_select(0, flat.view(-1)).view(flat.shape).long()


@dataclass
class _SharedPrefixes:
    """Decodes grouped by a shared cached prefix. They come first in the decode order, group by group, so that
    a group's queries and own-suffix results are plain rows of the decode tensors."""

    groups: int
    width: int
    """The most members of any group."""
    members: int
    """Grouped decodes in all: the first `members` rows of the decode order."""
    padded: torch.Tensor | None
    """[G * width] decode rows laid out [group, member], padding repeating a member of the group; None when
    every group has `width` members (then the rows are that layout as they come)."""
    real: torch.Tensor | None
    """[members] the real entries of that padded layout; None without padding."""
    slots: torch.Tensor
    """[G, P] KV slots of each group's prefix (padded with slot 0)."""
    bias: torch.Tensor | None
    """[G, 1, 1, P] additive mask, -inf past a shorter prefix; None when all prefixes have the same length."""
    lengths: np.ndarray
    """[G] each group's prefix length."""
    sizes: list[int]
    """Members of each group."""
    kernel_args: tuple[torch.Tensor, torch.Tensor] | None = None
    """(prefix lengths [G], each decode row's group [rows], -1 past the members) as int32 tensors for the CPU
    kernel, made at its first step."""


@dataclass
class _DecodeOrder:
    """What planning a decode-only step derives from its batch's rows and prefix groups alone. The next step
    over the same rows, one token further, reuses it (with staging, on CPU)."""

    rows: list[int]
    groups: list[int] | None
    prefix_lens: list[int] | None
    kv_lens: np.ndarray
    order: np.ndarray
    """Batch index of each decode in decode order."""
    decode_rows: np.ndarray
    """Table row of each decode, in decode order."""
    tokens: torch.Tensor
    in_place: bool
    first: np.ndarray
    """Shared-prefix length of each decode, in decode order."""
    shared: _SharedPrefixes | None

    def continues(self, batch: ForwardBatch, kv_lens: np.ndarray) -> bool:
        """Whether `batch` (whose `kv_lens` as an array are given) is this plan's batch one token further."""
        return (
            batch.rows == self.rows
            and batch.prefix_groups == self.groups
            and batch.prefix_lens == self.prefix_lens
            and np.array_equal(kv_lens - 1, self.kv_lens)
        )


@dataclass
class _ShortExtends:
    """Multi-token chunks of at most `_SHORT_EXTEND` tokens, padded to [B, T] for one attention call."""

    batch_size: int
    width: int
    """T: the longest chunk."""
    tokens: torch.Tensor
    """[B * T] token rows of the step (padding repeats the chunk's first token)."""
    slots: torch.Tensor
    """[B, L] KV slots of each chunk's sequence."""
    allowed: np.ndarray
    """[B, T, L] causal visibility of each query."""
    src: torch.Tensor
    """Rows of the padded [B * T] output that are real ..."""
    dst: torch.Tensor
    """... and the step's token rows they go to."""
    mask: torch.Tensor | None = None
    """[B, 1, T * G, L] SDPA mask, built at the first layer (needs the query dtype)."""


class TorchPagedAttention:
    def __init__(
        self,
        pool: KVPool,
        table: RequestTable,
        batch: ForwardBatch,
        staging: DecodeStaging | None = None,
        cpu_kernel: bool = False,
    ) -> None:
        """`cpu_kernel`: whether the C decode kernel (cpu_kernel.py) has code for this model's decodes; it
        runs on the steps that stage (CPU)."""
        self.pool, self.out_slots = pool, batch.out_slots
        self.staging = staging
        self.cpu_kernel = cpu_kernel
        self.staged = False
        self.dec_tokens: torch.Tensor | None = None
        self.dec_in_place = False
        self.shared: _SharedPrefixes | None = None
        self.kernel: cpu_kernel.DecodePlan | None = None
        decode_only = bool(batch.q_lens) and max(batch.q_lens) == 1
        if decode_only and staging is not None and staging.order is not None:
            kv_lens = np.asarray(batch.kv_lens)
            if staging.order.continues(batch, kv_lens):
                self.short, self.prefills, self.fresh_runs = None, [], []
                staging.order.kv_lens = kv_lens
                self._plan_step(table, staging.order)
                return
        starts = batch.q_starts
        short = [i for i, n in enumerate(batch.q_lens) if 1 < n <= _SHORT_EXTEND]
        self.short = self._plan_short(table, batch, short, starts) if len(short) > 1 else None
        batched = set(short) if self.short is not None else set()
        long = [i for i, n in enumerate(batch.q_lens) if n > 1 and i not in batched]
        self.fresh_runs = _fresh_runs(batch, long, starts) if self.pool.device.type == "cpu" else []
        in_runs = {i for run in self.fresh_runs for i in run.chunks}
        self.prefills = [
            (starts[i], starts[i + 1], table.table[batch.rows[i], : batch.kv_lens[i]].long())
            for i in long
            if i not in in_runs
        ]
        decodes = [i for i, n in enumerate(batch.q_lens) if n == 1]
        if decodes:
            plan = self._plan_order(table, batch, decodes, starts)
            if staging is not None:
                staging.order = plan if decode_only else None
            self._plan_step(table, plan)
        elif staging is not None:
            staging.clear()

    def _plan_order(
        self, table: RequestTable, batch: ForwardBatch, decodes: list[int], starts: list[int]
    ) -> _DecodeOrder:
        device = self.pool.device
        groups: list[tuple[int, list[int]]] = []  # (shared prefix length, members as batch indices)
        if device.type == "cpu" and batch.prefix_groups is not None:
            found: dict[tuple[int, int], list[int]] = {}
            for i in decodes:
                key, length = batch.prefix_groups[i], batch.prefix_lens[i]  # type: ignore[index]
                if key >= 0 and _MIN_SHARED_PREFIX <= length < batch.kv_lens[i]:
                    found.setdefault((key, length), []).append(i)
            groups = [(length, idx) for (_, length), idx in found.items() if len(idx) >= 2]
        prefix = {i: length for length, idx in groups for i in idx}
        order = np.array([i for _, idx in groups for i in idx] + [i for i in decodes if i not in prefix])
        tokens = np.asarray(starts)[order]
        return _DecodeOrder(
            rows=batch.rows,
            groups=batch.prefix_groups,
            prefix_lens=batch.prefix_lens,
            kv_lens=np.asarray(batch.kv_lens),
            order=order,
            decode_rows=np.asarray(batch.rows)[order],
            tokens=host_to_device(tokens, device),
            # A decode-only step whose rows are already in this order needs no gather of q nor scatter of the
            # output.
            in_place=not self.prefills
            and not self.fresh_runs
            and self.short is None
            and bool((tokens == np.arange(len(order))).all()),
            first=np.array([prefix.get(i, 0) for i in order.tolist()]),
            shared=self._plan_groups(table, batch, groups) if groups else None,
        )

    def _plan_step(self, table: RequestTable, plan: _DecodeOrder) -> None:
        """The decode rows' per-step plan: their suffixes, the staging or gathers that bring them, the mask."""
        device, lay = self.pool.device, self.pool.layout
        self.dec_tokens, self.dec_in_place, self.shared = plan.tokens, plan.in_place, plan.shared
        order, first = plan.order, plan.first
        suffix = plan.kv_lens[order] - first
        width = int(suffix.max())
        rows = plan.decode_rows
        if self.staging is not None:
            tenancy = table.tenancy[rows]
            kernel = self.cpu_kernel and cpu_kernel.usable()
            self.staged = device.type == "cpu" and self.staging.begin(rows, tenancy, first, suffix, kernel)
            if self.staged and self.shared is None:
                self.staging.no_prefix()
            if self.staged and kernel:  # None where the plan fails its checks: the flash path runs
                self.kernel = cpu_kernel.kernel.run(self._kernel_plan, suffix, len(rows))
        self.dec_slots: torch.Tensor | None = None
        if not (self.staged and self.staging.appending):  # type: ignore[union-attr]
            cols = np.minimum(first[:, None] + np.arange(width), table.max_context - 1)
            # Position-major: a step's decodes usually got their slots together, so this reads the pool in
            # order.
            self.dec_slots = _table_slots(table, rows, cols).T.contiguous()
        self.dec_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        if not self.staged:
            shape = (width, len(order), lay.num_kv_heads, lay.head_dim)
            self.dec_buffers = (
                torch.empty(shape, dtype=lay.dtype, device=device),
                torch.empty(shape, dtype=lay.dtype, device=device),
            )
        self.dec_suffix = suffix
        self.dec_mask: torch.Tensor | None = None
        self.dec_mask_made = False

    def _suffix_mask(self) -> torch.Tensor | None:
        """The suffix attention's mask, made at its first layer (the C kernel needs none); None when every
        suffix has the same length (e.g. the samples of a group), which lets SDPA take its fused kernel."""
        if not self.dec_mask_made:
            suffix, width = self.dec_suffix, int(self.dec_suffix.max())
            if suffix.min() < width:
                allowed = (np.arange(width) < suffix[:, None])[:, None, None, :]
                self.dec_mask = _step_mask(allowed, self.pool.layout.dtype, self.pool.device)
            self.dec_mask_made = True
        return self.dec_mask

    def _kernel_plan(self, suffix: np.ndarray, rows: int) -> cpu_kernel.DecodePlan:
        sh = self.shared
        lengths = torch.from_numpy(suffix.astype(np.int32))
        if sh is None:
            return cpu_kernel.DecodePlan(lengths)
        if sh.kernel_args is None:
            row_group = np.full(rows, -1, dtype=np.int32)
            row_group[: sh.members] = np.repeat(np.arange(sh.groups, dtype=np.int32), sh.sizes)
            sh.kernel_args = (torch.from_numpy(sh.lengths.astype(np.int32)), torch.from_numpy(row_group))
        return cpu_kernel.DecodePlan(lengths, *sh.kernel_args)

    def _plan_short(
        self, table: RequestTable, batch: ForwardBatch, idx: list[int], starts: list[int]
    ) -> _ShortExtends:
        """Chunks of a few tokens (speculative verify chunks, small prefill pieces) attend in one padded call
        instead of one call per sequence."""
        device = self.pool.device
        q_lens = np.asarray([batch.q_lens[i] for i in idx])
        kv_lens = np.asarray([batch.kv_lens[i] for i in idx])
        first = np.asarray([starts[i] for i in idx])
        b, t, width = len(idx), int(q_lens.max()), int(kv_lens.max())
        j = np.arange(t)
        real = j[None, :] < q_lens[:, None]  # [B, T]
        tokens = first[:, None] + np.where(real, j[None, :], 0)
        # Query j of a chunk sits at position kv_len - q_len + j and sees keys up to it (causal).
        last_key = kv_lens[:, None] - q_lens[:, None] + j[None, :]
        allowed = np.arange(width)[None, None, :] <= last_key[:, :, None]  # [B, T, L]
        cols = np.minimum(np.arange(width), table.max_context - 1)[None, :].repeat(b, 0)
        return _ShortExtends(
            batch_size=b,
            width=t,
            tokens=host_to_device(tokens.reshape(-1), device),
            slots=_table_slots(table, np.asarray([batch.rows[i] for i in idx]), cols),
            allowed=allowed,
            src=host_to_device(np.flatnonzero(real.reshape(-1)), device),
            dst=host_to_device(tokens.reshape(-1)[real.reshape(-1)], device),
        )

    def _short(self, layer_idx: int, q: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        sh = self.short
        assert sh is not None
        _, hq, d = q.shape
        hkv = self.pool.layout.num_kv_heads
        g = hq // hkv
        if sh.mask is None:  # the query heads of a KV head ride in the query dimension: [B, Hkv, T * G]
            sh.mask = _step_mask(np.repeat(sh.allowed, g, axis=1)[:, None], q.dtype, q.device)
        qs = q.index_select(0, sh.tokens).view(sh.batch_size, sh.width, hkv, g, d)
        qs = qs.permute(0, 2, 1, 3, 4).reshape(sh.batch_size, hkv, sh.width * g, d)
        keys, values = self.pool.gather(layer_idx, sh.slots)  # [B, L, Hkv, D]
        o = F.scaled_dot_product_attention(
            qs, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=sh.mask, scale=scale
        )
        o = o.view(sh.batch_size, hkv, sh.width, g, d).permute(0, 2, 1, 3, 4).reshape(-1, hq, d)
        out.index_copy_(0, sh.dst, o.index_select(0, sh.src))

    def _plan_groups(
        self, table: RequestTable, batch: ForwardBatch, groups: list[tuple[int, list[int]]]
    ) -> _SharedPrefixes:
        device, lay = self.pool.device, self.pool.layout
        sizes = [len(idx) for _, idx in groups]
        width = max(sizes)
        padded = real = None
        if min(sizes) < width:
            layout, entries, start = [], [], 0
            for g, size in enumerate(sizes):
                layout += [*range(start, start + size), *[start] * (width - size)]
                entries += range(g * width, g * width + size)
                start += size
            padded, real = host_to_device(np.array(layout), device), host_to_device(np.array(entries), device)
        lengths = np.array([length for length, _ in groups])
        positions = np.arange(lengths.max())
        beyond = positions >= lengths[:, None]
        rows = np.array([batch.rows[idx[0]] for _, idx in groups])
        slots = _table_slots(table, rows, np.where(beyond, 0, positions))
        bias = None
        if beyond.any():
            slots.masked_fill_(host_to_device(beyond, device), 0)
            bias = _step_mask(~beyond[:, None, None, :], lay.dtype, device)
        return _SharedPrefixes(len(groups), width, sum(sizes), padded, real, slots, bias, lengths, sizes)

    def kv_write(self, layer_idx: int) -> None:
        return None  # the reference backend writes through `pool.write`

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        assert k is not None and v is not None
        self.pool.write(layer_idx, self.out_slots, k, v)
        if self.dec_in_place:
            return self._decode(layer_idx, q, k, v, scale).reshape(q.shape)
        out = torch.empty_like(q)
        if self.dec_tokens is not None:
            index = self.dec_tokens
            dec_k, dec_v = k, v
            if self.staged:  # the staged copies take the decode rows' new keys and values
                dec_k, dec_v = k.index_select(0, index), v.index_select(0, index)
            dec = self._decode(layer_idx, q.index_select(0, index), dec_k, dec_v, scale)
            out.view(len(out), *dec.shape[1:]).index_copy_(0, index, dec)
        if self.short is not None:
            self._short(layer_idx, q, out, scale)
        for run in self.fresh_runs:
            end = run.start + run.count * run.length
            out[run.start : end] = _fresh_prefill(
                q[run.start : end], k[run.start : end], v[run.start : end], run, scale
            )
        for start, end, slots in self.prefills:
            keys, values = self.pool.gather(layer_idx, slots)
            out[start:end] = _prefill(q[start:end], keys, values, scale)
        return out

    def _decode(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [B, Hq, D] in decode order -> [B, Hkv, Hq / Hkv, D] (in any memory layout); the query heads of
        each KV head ride in the query dimension. k/v: the step's new keys and values (in decode order where
        staged), already in the pool."""
        out = self._attend_decodes(layer_idx, q, k, v, scale)
        if self.staged:
            self.staging.layer_done(layer_idx)  # type: ignore[union-attr]
        return out

    def _attend_decodes(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        b, hq, d = q.shape
        hkv = self.pool.layout.num_kv_heads
        qg = q.reshape(b, hkv, hq // hkv, d)
        sh = self.shared
        if self.staged:
            keys, values = self.staging.suffix(layer_idx, self.dec_slots, k, v)  # type: ignore[union-attr]
            prefix = self.staging.prefix(layer_idx, sh.slots) if sh is not None else None  # type: ignore[union-attr]
        else:
            keys, values = self.pool.gather(layer_idx, self.dec_slots, self.dec_buffers)  # [L, B, Hkv, D]
            keys, values = keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)
            prefix = None
            if sh is not None:
                pk, pv = self.pool.gather(layer_idx, sh.slots)  # [G, P, Hkv, D]
                prefix = pk.transpose(1, 2), pv.transpose(1, 2)
        if self.kernel is not None:
            out = self.kernel.attend(q, prefix, (keys, values), scale)
            if out is not None:
                return out
            self.kernel = None  # off for good: the flash-attention path from this layer on
        if sh is None:
            return F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=self._suffix_mask(), scale=scale
            )
        out, lse = _flash_lse(qg, keys, values, self._suffix_mask(), scale)
        assert prefix is not None
        g, m = sh.groups, sh.width
        grouped = qg[: g * m] if sh.padded is None else qg.index_select(0, sh.padded)
        # Every member's queries against its group's one prefix: [G, Hkv, M * (Hq / Hkv), D].
        gq = grouped.view(g, m, hkv, -1, d).transpose(1, 2).reshape(g, hkv, -1, d)
        p_out, p_lse = _flash_lse(gq, *prefix, sh.bias, scale)
        p_out = p_out.view(g, hkv, m, -1, d).transpose(1, 2)  # [G, M, Hkv, Hq / Hkv, D]
        p_lse = p_lse.view(g, hkv, m, -1).transpose(1, 2)
        own, own_lse = out[: sh.members], lse[: sh.members]
        if sh.real is None:
            own, own_lse = own.view(g, m, hkv, -1, d), own_lse.view(g, m, hkv, -1)
        else:
            p_out = p_out.reshape(g * m, hkv, -1, d).index_select(0, sh.real)
            p_lse = p_lse.reshape(g * m, hkv, -1).index_select(0, sh.real)
        # Softmax over prefix and own suffix together: the partial results weighted by their shares of the
        # total mass, exp(p_lse) / (exp(p_lse) + exp(own_lse)) for the prefix.
        weight = torch.sigmoid(p_lse - own_lse).unsqueeze(-1)
        if own.dtype == torch.float32:
            own.lerp_(p_out, weight)
        else:
            own.copy_(torch.lerp(own.float(), p_out.float(), weight))
        return out


class RowwiseAttention:
    """Per query row, over exactly positions [0, pos]; rows with table row -1 are padding (output 0)."""

    def __init__(
        self,
        pool: KVPool,
        table: RequestTable,
        rows: list[int],
        positions: list[int],
        out_slots: torch.Tensor,
    ) -> None:
        self.pool, self.out_slots = pool, out_slots
        self.slots = [table.table[r, : p + 1].long() if r >= 0 else None for r, p in zip(rows, positions)]

    def kv_write(self, layer_idx: int) -> None:
        return None  # the reference backend writes through `pool.write`

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        assert k is not None and v is not None
        self.pool.write(layer_idx, self.out_slots, k, v)
        out = torch.zeros_like(q)
        for i, slots in enumerate(self.slots):
            if slots is not None:
                keys, values = self.pool.gather(layer_idx, slots)
                out[i] = sdpa(q[i : i + 1], keys, values, scale, causal=False)[0]
        return out
