"""The torch paged attention backend against plain attention over each sequence's whole context."""

from __future__ import annotations

import pytest
import torch

from miles.models.attention import sdpa
from miles.rollout.attention.torch_backend import TorchPagedAttention
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv.pool import KVLayout, KVPool, RequestTable

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


FRESH = [(0, -1, 0, 0, 20), (1, -1, 0, 0, 20), (2, -1, 0, 0, 20), (3, -1, 0, 0, 24), (4, -1, 0, 30, 1)]
FRESH += [(5, -1, 0, 0, 20), (6, -1, 0, 8, 20)]
"""Whole prompts (nothing cached): three of 20 tokens side by side, one of 24, and after a decode one more of
20; then a 20-token chunk after 8 cached tokens (it reads the pool)."""


def test_whole_prompts_of_one_length_attend_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, table, batch = build(FRESH)
    attention = TorchPagedAttention(pool, table, batch)
    assert [(run.chunks, run.count, run.length) for run in attention.fresh_runs] == [
        ([0, 1, 2], 3, 20),
        ([3], 1, 24),
        ([5], 1, 20),
    ]
    assert [start for start, _, _ in attention.prefills] == [105]  # the chunk after cached tokens
    assert_matches_plain_attention(attention, pool, table, batch, seed=3)
    # The same numbers as one call per sequence over keys gathered from the pool.
    gen = torch.Generator().manual_seed(4)
    n = batch.num_tokens
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
    batched = attention.attend(0, q, k, v, D**-0.5)
    monkeypatch.setattr("miles.rollout.attention.torch_backend._fresh_runs", lambda *args: [])
    one_by_one = TorchPagedAttention(pool, table, batch)
    assert not one_by_one.fresh_runs and len(one_by_one.prefills) == 6
    assert torch.equal(one_by_one.attend(0, q, k, v, D**-0.5), batched)


def _decode_step(
    table: RequestTable, rows: list[tuple[int, int, int, int]], step: int
) -> tuple[ForwardBatch, list[int]]:
    """One decode token for each (table row, group, prefix length, context at step 0), `step` steps in."""
    kv_lens = [start + step + 1 for *_, start in rows]
    out_slots = torch.stack([table.table[row, n - 1] for (row, *_), n in zip(rows, kv_lens)]).long()
    batch = ForwardBatch(
        input_ids=torch.zeros(len(rows), dtype=torch.long),
        positions=torch.zeros(len(rows), dtype=torch.long),
        out_slots=out_slots,
        rows=[r[0] for r in rows],
        q_lens=[1] * len(rows),
        kv_lens=kv_lens,
        sample_index=torch.arange(len(rows)),
        prefix_groups=[r[1] for r in rows],
        prefix_lens=[r[2] for r in rows],
    )
    return batch, kv_lens


@pytest.mark.parametrize("layout", ["flash", "kernel", "kernel fails"])
def test_staged_decode_steps_equal_fresh_gathers(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive decode steps that carry their plan, keys and values over (DecodeStaging) attend exactly as
    steps that plan and gather everything again: appending one token per step at equal and unequal suffix lengths,
    after a row leaves, when a suffix outgrows the staged capacity, and after a forward failed half-way. With
    the C decode kernel the staged steps run it against the flash path; where it fails, the flash path runs
    over the copies staged for it, and later steps stage for the flash path again."""
    from miles.rollout.attention import cpu_kernel
    from miles.rollout.attention.decode_staging import DecodeStaging

    use_kernel = layout != "flash"
    monkeypatch.setattr(cpu_kernel.kernel, "on", True)
    if layout == "kernel fails":

        def broken() -> None:
            raise RuntimeError("no compiler")

        monkeypatch.setattr(cpu_kernel, "_load", broken)

    layers, gen = 2, torch.Generator().manual_seed(3)
    pool = KVPool(KVLayout(layers, HKV, D, torch.float32, 1, None), 2048, torch.device("cpu"))
    table = RequestTable(8, 160, torch.device("cpu"))
    # Rows 0-2 share the slots of a 20-token prefix (group 7); rows 3-4 are alone; all own 120 more slots.
    prefix = torch.arange(1, 21, dtype=torch.int32)
    for row in range(5):
        own = torch.arange(21 + 120 * row, 141 + 120 * row, dtype=torch.int32)
        slots = torch.cat([prefix, own]) if row < 3 else own
        table.table[row, : len(slots)] = slots
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=gen))  # type: ignore[union-attr]
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=gen))  # type: ignore[union-attr]
    staging = DecodeStaging(pool)
    gathers = 0
    gather = pool.gather

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal gathers
        gathers += 1
        return gather(*args, **kwargs)  # type: ignore[arg-type]

    pool.gather = counted  # type: ignore[method-assign]
    everyone = [(0, 7, 20, 22), (1, 7, 20, 25), (2, 7, 20, 21), (3, -1, 0, 40), (4, -1, 0, 40)]
    schedule = [(everyone, s) for s in range(4)]  # unequal suffixes: rows 0-2 grow from 2, 5 and 1
    schedule += [(everyone[:2] + everyone[3:], s) for s in range(4, 8)]  # row 2 left the batch
    schedule += [(everyone[3:], s) for s in range(8, 80)]  # equal suffixes of 49..120: outgrow 64, then 112
    for i, (rows, step) in enumerate(schedule):
        batch, _ = _decode_step(table, rows, step)
        n = len(rows)
        q = torch.randn(n, HQ, D, generator=gen)
        kv = [
            (torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen))
            for _ in range(layers)
        ]
        if i == 10:  # this forward fails after its first layer: the next step must not append to stale copies
            TorchPagedAttention(pool, table, batch, staging, use_kernel).attend(0, q, *kv[0], D**-0.5)
            continue
        before, planned = gathers, staging.order
        staged = TorchPagedAttention(pool, table, batch, staging, use_kernel)
        # The same rows one token further reuse the last step's plan, even after a failed forward.
        assert (staging.order is planned) == (i > 0 and schedule[i - 1][0] == rows)
        out = [staged.attend(layer, q, *kv[layer], D**-0.5) for layer in range(layers)]
        assert (staged.kernel is not None) == (layout == "kernel")
        assert staging.transposed_keys == (layout == "kernel" or (layout == "kernel fails" and i == 0))
        appended = gathers == before
        fresh = TorchPagedAttention(pool, table, batch)
        for layer in range(layers):
            ref = fresh.attend(layer, q, *kv[layer], D**-0.5)
            torch.testing.assert_close(out[layer], ref, atol=1e-6, rtol=1e-6)
        # After the kernel failed at step 0, step 1 stages for the flash path afresh.
        first_of_run = (
            i == 0 or schedule[i - 1][0] != rows or i == 11 or (layout == "kernel fails" and i == 1)
        )
        # Rows 3-4 staged 112 positions (2 x 52, in whole blocks of 16) at step 11; their suffixes reach 113 here.
        grew = step == 72
        assert appended == (not first_of_run and not grew), (i, step, appended)
    assert staging.capacity == 240  # 2 x 113 in whole blocks
