"""The `torch` attention backend: readable paged attention over the KV pool, CPU and GPU.

`TorchPagedAttention` writes the step's new keys/values into their slots, then attends. Single-token
sequences (decodes) go together through one SDPA call; the query heads that share a KV head are folded
into the query dimension, so keys and values are never repeated for grouped-query attention. On CPU,
decodes whose requests share a cached prefix (the `n` samples of a group) attend to that prefix once per
group ("cascade" attention): prefix and own-suffix partial results are merged through their log-sum-exp.
Longer sequences (prefill chunks) go one at a time.

`RowwiseAttention` is the deterministic variant: every query row attends over exactly its own prefix in a
call of its own, so its result cannot depend on which other rows share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models.attention import sdpa
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv_pool import KVPool, RequestTable

_MIN_SHARED_PREFIX = 16
"""Shorter shared prefixes are not worth a separate attention call."""


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, D], k/v [B, H, Lk, D] -> (out [B, H, Lq, D], logsumexp of the scores [B, H, Lq] float32)."""
    if q.device.type == "cpu":
        bias = None
        if mask is not None:  # the kernel takes an additive mask
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


@dataclass
class _SharedPrefixes:
    """Decodes grouped by a shared cached prefix, padded to [groups, max members] and [groups, max prefix]."""

    members: torch.Tensor
    """[G, M] indices into the decode list (padding repeats a valid member)."""
    valid: torch.Tensor
    """[G, M] which entries of `members` are real."""
    slots: torch.Tensor
    """[G, P] KV slots of each group's prefix (padded with slot 0)."""
    mask: torch.Tensor | None
    """[G, 1, 1, P] True on real prefix positions; None when all prefixes have the same length."""


class TorchPagedAttention:
    def __init__(self, pool: KVPool, table: RequestTable, batch: ForwardBatch) -> None:
        self.pool, self.out_slots = pool, batch.out_slots
        starts = batch.q_starts
        decodes = [i for i, n in enumerate(batch.q_lens) if n == 1]
        self.dec_tokens: torch.Tensor | None = None
        self.shared: _SharedPrefixes | None = None
        if decodes:
            self._plan_decodes(table, batch, decodes, [starts[i] for i in decodes])
        self.prefills = [
            (starts[i], starts[i + 1], table.table[batch.rows[i], : batch.kv_lens[i]].long())
            for i, n in enumerate(batch.q_lens)
            if n > 1
        ]

    def _plan_decodes(
        self, table: RequestTable, batch: ForwardBatch, decodes: list[int], tokens: list[int]
    ) -> None:
        device = self.pool.device
        kv_lens = [batch.kv_lens[i] for i in decodes]
        prefix = [0] * len(decodes)
        if device.type == "cpu" and batch.prefix_groups is not None:
            members: dict[tuple[int, int], list[int]] = {}
            for j, i in enumerate(decodes):
                key, length = batch.prefix_groups[i], batch.prefix_lens[i]  # type: ignore[index]
                if key >= 0 and _MIN_SHARED_PREFIX <= length < kv_lens[j]:
                    members.setdefault((key, length), []).append(j)
            groups = [(length, idx) for (_, length), idx in members.items() if len(idx) >= 2]
            if groups:
                self.shared = self._plan_groups(table, batch, decodes, groups)
                for length, idx in groups:
                    for j in idx:
                        prefix[j] = length
        suffix = [n - p for n, p in zip(kv_lens, prefix)]
        width = max(suffix)
        rows = torch.tensor([batch.rows[i] for i in decodes], device=device)
        first = torch.tensor(prefix, device=device)
        cols = (first[:, None] + torch.arange(width, device=device)[None, :]).clamp(max=table.max_context - 1)
        self.dec_tokens = torch.tensor(tokens, device=device)
        self.dec_slots = table.table[rows[:, None], cols].long()
        shape = (len(decodes), width, self.pool.layout.num_kv_heads, self.pool.layout.head_dim)
        self.dec_buffers = (
            torch.empty(shape, dtype=self.pool.layout.dtype, device=device),
            torch.empty(shape, dtype=self.pool.layout.dtype, device=device),
        )
        # Equal lengths (e.g. the samples of a group) need no mask, which lets SDPA take its fused kernel.
        lens = torch.tensor(suffix, device=device)
        valid = torch.arange(width, device=device)[None, :] < lens[:, None]
        self.dec_mask = None if min(suffix) == width else valid[:, None, None, :]

    def _plan_groups(
        self,
        table: RequestTable,
        batch: ForwardBatch,
        decodes: list[int],
        groups: list[tuple[int, list[int]]],
    ) -> _SharedPrefixes:
        device = self.pool.device
        width = max(len(idx) for _, idx in groups)
        longest = max(length for length, _ in groups)
        members = torch.tensor([idx + [idx[0]] * (width - len(idx)) for _, idx in groups], device=device)
        valid = (
            torch.arange(width, device=device)[None, :]
            < torch.tensor([len(i) for _, i in groups], device=device)[:, None]
        )
        rows = torch.tensor([batch.rows[decodes[idx[0]]] for _, idx in groups], device=device)
        lengths = torch.tensor([length for length, _ in groups], device=device)
        positions = torch.arange(longest, device=device)[None, :]
        slots = table.table[rows[:, None], positions].long().masked_fill(positions >= lengths[:, None], 0)
        uniform = all(length == longest for length, _ in groups)
        mask = None if uniform else (positions < lengths[:, None])[:, None, None, :]
        return _SharedPrefixes(members, valid, slots, mask)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self.pool.write(layer_idx, self.out_slots, k, v)
        out = torch.empty_like(q)
        if self.dec_tokens is not None:
            out[self.dec_tokens] = self._decode(layer_idx, q[self.dec_tokens], scale)
        for start, end, slots in self.prefills:
            keys, values = self.pool.gather(layer_idx, slots)
            out[start:end] = sdpa(q[start:end], keys, values, scale, causal=True)
        return out

    def _decode(self, layer_idx: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]; the Hq / Hkv query heads of each KV head ride in the query dimension."""
        b, hq, d = q.shape
        hkv = self.pool.layout.num_kv_heads
        qg = q.view(b, hkv, hq // hkv, d)
        keys, values = self.pool.gather(layer_idx, self.dec_slots, self.dec_buffers)  # [B, L, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if self.shared is None:
            return F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=self.dec_mask, scale=scale
            ).reshape(b, hq, d)  # CUDA SDPA kernels may return a transposed (non-contiguous) layout
        out, lse = _attention_lse(qg, keys, values, self.dec_mask, scale)
        sh = self.shared
        groups, width = sh.members.shape
        pk, pv = self.pool.gather(layer_idx, sh.slots)  # [G, P, Hkv, D]
        # Every member's queries against its group's one prefix: [G, Hkv, M * (Hq / Hkv), D].
        gq = qg[sh.members].permute(0, 2, 1, 3, 4).reshape(groups, hkv, -1, d)
        p_out, p_lse = _attention_lse(gq, pk.transpose(1, 2), pv.transpose(1, 2), sh.mask, scale)
        p_out = p_out.reshape(groups, hkv, width, -1, d).permute(0, 2, 1, 3, 4)[
            sh.valid
        ]  # [members, Hkv, G, D]
        p_lse = p_lse.reshape(groups, hkv, width, -1).permute(0, 2, 1, 3)[sh.valid]
        idx = sh.members[sh.valid]
        s_out, s_lse = out[idx].float(), lse[idx]
        total = torch.logaddexp(p_lse, s_lse)
        merged = (
            p_out.float() * torch.exp(p_lse - total)[..., None] + s_out * torch.exp(s_lse - total)[..., None]
        )
        out[idx] = merged.to(out.dtype)
        return out.reshape(b, hq, d)


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

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self.pool.write(layer_idx, self.out_slots, k, v)
        out = torch.zeros_like(q)
        for i, slots in enumerate(self.slots):
            if slots is not None:
                keys, values = self.pool.gather(layer_idx, slots)
                out[i] = sdpa(q[i : i + 1], keys, values, scale, causal=False)[0]
        return out
