"""The `torch` attention backend: readable paged attention over the KV pool, CPU and GPU.

`TorchPagedAttention` writes the step's new keys/values into their slots, then attends: all single-token
sequences (decodes) in one padded SDPA call, longer ones (prefill chunks) one sequence at a time.
`RowwiseAttention` is the deterministic variant: every query row attends over exactly its own prefix in a
call of its own, so its result cannot depend on which other rows share the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.models.attention import sdpa
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv_pool import KVPool, RequestTable


class TorchPagedAttention:
    def __init__(self, pool: KVPool, table: RequestTable, batch: ForwardBatch) -> None:
        self.pool, self.out_slots = pool, batch.out_slots
        device = pool.device
        starts = batch.q_starts
        decodes = [i for i, n in enumerate(batch.q_lens) if n == 1]
        self.dec_tokens: torch.Tensor | None = None
        if decodes:
            lens = torch.tensor([batch.kv_lens[i] for i in decodes], device=device)
            max_len = max(batch.kv_lens[i] for i in decodes)
            rows = torch.tensor([batch.rows[i] for i in decodes], device=device)
            self.dec_tokens = torch.tensor([starts[i] for i in decodes], device=device)
            self.dec_slots = table.table[rows, :max_len].long()
            self.dec_mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
        self.prefills = [
            (starts[i], starts[i + 1], table.table[batch.rows[i], : batch.kv_lens[i]].long())
            for i, n in enumerate(batch.q_lens)
            if n > 1
        ]

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self.pool.write(layer_idx, self.out_slots, k, v)
        out = torch.empty_like(q)
        if self.dec_tokens is not None:
            keys, values = self.pool.gather(layer_idx, self.dec_slots)  # [B, L, Hkv, D]
            o = F.scaled_dot_product_attention(
                q[self.dec_tokens].unsqueeze(2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=self.dec_mask,
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            out[self.dec_tokens] = o.squeeze(2)
        for start, end, slots in self.prefills:
            keys, values = self.pool.gather(layer_idx, slots)
            out[start:end] = sdpa(q[start:end], keys, values, scale, causal=True)
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
