"""The torch paged attention backend against plain attention over each sequence's whole context."""

from __future__ import annotations

import pytest
import torch

from miles.models.attention import sdpa
from miles.rollout.attention_torch import TorchPagedAttention
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv_pool import KVLayout, KVPool, RequestTable

HKV, HQ, D = 2, 4, 16

# (table row, shared-prefix group id (-1: none), prefix length, context before this step, new tokens)
MIXED = [
    (0, 7, 20, 22, 1),
    (6, -1, 0, 10, 6),  # a prefill chunk between the decodes
    (3, 9, 17, 18, 1),
    (1, 7, 20, 20, 1),
    (5, -1, 0, 24, 1),
    (4, 9, 17, 19, 1),
    (2, 7, 20, 25, 1),
    (7, -1, 0, 0, 5),  # a whole prompt
]
"""Groups of 3 and 2 members (padded), prefixes of 20 and 17 (masked), out of order, plus lone sequences."""

UNIFORM = [(r, r // 4, 24, 24 + r % 4, 1) for r in range(8)]
"""Two groups of 4 in batch order with one prefix length: nothing padded, masked or reordered for them."""


def build(seqs: list[tuple[int, int, int, int, int]]) -> tuple[KVPool, RequestTable, ForwardBatch]:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(KVLayout(1, HKV, D, torch.float32, 1, None), 1024, torch.device("cpu"))
    table = RequestTable(8, 64, torch.device("cpu"))
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=gen))  # type: ignore[union-attr]
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=gen))  # type: ignore[union-attr]
    prefix_slots: dict[int, torch.Tensor] = {}
    next_slot, out_slots = 1, []
    for row, group, prefix, cached, new in seqs:
        own = torch.arange(next_slot, next_slot + cached + new - prefix, dtype=torch.int32)
        next_slot += len(own)
        if group >= 0:
            if group not in prefix_slots:
                prefix_slots[group] = torch.arange(next_slot, next_slot + prefix, dtype=torch.int32)
                next_slot += prefix
            own = torch.cat([prefix_slots[group], own])
        table.table[row, : len(own)] = own
        out_slots.append(own[cached:])
    tokens = sum(new for *_, new in seqs)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.zeros(tokens, dtype=torch.long),
        out_slots=torch.cat(out_slots).long(),
        rows=[s[0] for s in seqs],
        q_lens=[s[4] for s in seqs],
        kv_lens=[s[3] + s[4] for s in seqs],
        sample_index=torch.zeros(0, dtype=torch.long),
        prefix_groups=[s[1] for s in seqs],
        prefix_lens=[s[2] for s in seqs],
    )
    return pool, table, batch


def assert_matches_plain_attention(
    attention: TorchPagedAttention, pool: KVPool, table: RequestTable, batch: ForwardBatch, seed: int
) -> None:
    """Random q/k/v through `attention` equal causal attention over each sequence's whole context."""
    gen = torch.Generator().manual_seed(seed)
    n = batch.num_tokens
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    out = attention.attend(0, q, k, v, D**-0.5)
    keys, values = pool.k_layer(0).view(-1, HKV, D), pool.v_layer(0).view(-1, HKV, D)
    starts = batch.q_starts
    for i, (row, kv_len) in enumerate(zip(batch.rows, batch.kv_lens)):
        slots = table.table[row, :kv_len].long()
        ref = sdpa(q[starts[i] : starts[i + 1]], keys[slots], values[slots], D**-0.5, causal=True)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [MIXED, UNIFORM], ids=["mixed", "uniform"])
def test_paged_attention_equals_attention_over_the_whole_context(seqs: list) -> None:
    pool, table, batch = build(seqs)
    attention = TorchPagedAttention(pool, table, batch)
    assert attention.shared is not None, "the shared-prefix path is what this test is about"
    assert (attention.shared.padded is not None) == (seqs is MIXED)
    assert attention.dec_in_place == (seqs is UNIFORM)
    assert_matches_plain_attention(attention, pool, table, batch, seed=1)


EXTENDS = [(0, -1, 0, 30, 3), (1, -1, 0, 12, 5), (2, -1, 0, 40, 2), (3, -1, 0, 8, 20), (4, -1, 0, 25, 1)]
"""Speculative verify chunks of 3, 5 and 2 tokens (batched together), a 20-token prefill chunk (alone),
and a decode."""


def test_short_extends_attend_in_one_padded_call() -> None:
    pool, table, batch = build(EXTENDS)
    attention = TorchPagedAttention(pool, table, batch)
    assert attention.short is not None and attention.short.batch_size == 3
    assert len(attention.prefills) == 1
    assert_matches_plain_attention(attention, pool, table, batch, seed=2)
