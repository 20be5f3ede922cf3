"""The KV slot allocator (`KVManager.alloc_extend`, `truncate`) and the page table handed to flashinfer
(`paged_kv_metadata`), against what they must hold, over random chunk sequences on CPU tensors."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.rollout.attention.flashinfer_backend import paged_kv_metadata
from miles.rollout.kv.manager import KVManager
from miles.rollout.kv.pool import KVLayout, KVPool, RequestTable


def _check(kv: KVManager, lens: list[int]) -> None:
    """Every held position's slot lies in a page of its own request, at the position's offset in the page;
    a request's positions of one page share it; no page is held twice, none is page 0; the free count adds up."""
    p, table = kv.page_size, kv.table.table
    owner: dict[int, int] = {}
    for row, n in enumerate(lens):
        slots = table[row, :n].long()
        pos = torch.arange(n)
        assert torch.equal(slots % p, pos % p), f"row {row}: slots off their page offsets"
        pages = slots // p
        for page_index in range(-(-n // p)):
            held = pages[page_index * p : (page_index + 1) * p].unique().tolist()
            assert len(held) == 1, f"row {row}: page {page_index} split over {held}"
            assert held[0] != 0 and owner.setdefault(held[0], row) == row, f"page {held[0]} held twice"
    assert kv.pool.num_free_pages == kv.pool.num_pages - 1 - len(owner)


@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 16])
def test_random_chunks_keep_the_page_table_whole(page_size: int) -> None:
    rng = random.Random(page_size)
    rows, context = 6, 70
    layout = KVLayout(1, 1, 2, torch.float32, page_size, None)
    pool = KVPool(layout, rows * -(-context // page_size) + 1, torch.device("cpu"))
    kv = KVManager(pool, RequestTable(rows, context, torch.device("cpu")), None)
    lens = [0] * rows
    for _ in range(300):
        op = rng.random()
        if op < 0.1:  # drop the tail (rejected drafts): whole pages past the kept length go back
            row = rng.randrange(rows)
            keep = rng.randint(0, lens[row])
            req = SimpleNamespace(row=row, kv_len=lens[row])  # what truncate reads and sets of a Request
            kv.truncate([(req, keep)])  # type: ignore[list-item]
            lens[row] = keep
            # The kept length's partial page stays whole; the table past it is stale, never read.
        elif op < 0.15:  # free a request's KV
            row = rng.randrange(rows)
            if lens[row]:
                pool.free_slots(kv.table.table[row, : lens[row]].clone())
                lens[row] = 0
        else:  # one step: a chunk (decode or extend) for some of the rows
            chosen = sorted(rng.sample(range(rows), rng.randint(1, rows)))
            grow = [min(rng.choice([1, 1, 1, rng.randint(1, 20)]), context - lens[r]) for r in chosen]
            chosen, grow = [r for r, g in zip(chosen, grow) if g], [g for g in grow if g]
            if not chosen:
                continue
            starts = np.array([lens[r] for r in chosen], dtype=np.int64)
            counts = np.array(grow, dtype=np.int64)
            slots = kv.alloc_extend(np.array(chosen, dtype=np.int64), starts, counts)
            expected = torch.cat([kv.table.table[r, s : s + g] for r, s, g in zip(chosen, starts, grow)])
            assert slots.dtype == torch.int64 and torch.equal(slots, expected.long())
            for r, g in zip(chosen, grow):
                lens[r] += g
        _check(kv, lens)
        held = [r for r in range(rows) if lens[r]]
        if held:  # the flashinfer page table of a batch over the rows holding KV (duplicates allowed)
            batch = [rng.choice(held) for _ in range(rng.randint(1, 8))]
            indptr, indices, last = paged_kv_metadata(kv.table, batch, [lens[r] for r in batch], page_size)
            for i, r in enumerate(batch):
                pages = indices[indptr[i] : indptr[i + 1]].tolist()
                assert pages == (kv.table.table[r, : lens[r] : page_size].long() // page_size).tolist()
                assert last[i] == lens[r] - (len(pages) - 1) * page_size
