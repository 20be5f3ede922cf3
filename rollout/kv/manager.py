"""KV bookkeeping of requests: admission through the radix cache, slot allocation, caching, release.

Ownership: positions [0, prefix_len) of a request are slots held by the radix tree and pinned by a lock on
`req.node`; positions [prefix_len, kv_len) are the request's own. Giving a request's KV back (finish,
retract, abort) inserts its computed tokens into the tree, frees the slots the tree already had
(duplicates) and the partial last page, and unpins. Without a tree a request owns all of its slots.
"""

from __future__ import annotations

import numpy as np
import torch

from miles.rollout.forward_batch import concat_ranges, host_to_device
from miles.rollout.kv.pool import KVPool, RequestTable
from miles.rollout.kv.radix_cache import RadixCache
from miles.rollout.request import Request


class KVManager:
    def __init__(self, pool: KVPool, table: RequestTable, tree: RadixCache | None) -> None:
        self.pool, self.table, self.tree = pool, table, tree
        self.page_size = pool.page_size

    # accounting ----------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Free slots plus slots the tree could give up."""
        return self.pool.free_tokens + (self.tree.evictable_size if self.tree else 0)

    def used_tokens(self) -> int:
        return self.pool.capacity_tokens - self.pool.free_tokens

    def match_length(self, req: Request) -> int:
        if self.tree is None:
            return 0
        return self.tree.match_prefix(req.tokens(0, req.seq_len - 1)).length

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        p = self.page_size
        return -(-(req.kv_len + num_tokens) // p) - -(-req.kv_len // p)

    def ensure_free(self, num_tokens: int) -> bool:
        """Make `num_tokens` slots free, evicting from the tree if needed."""
        short = num_tokens - self.pool.free_tokens
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.pool.free_tokens >= num_tokens

    # lifecycle -----------------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """Give the request a table row and its cached prefix (locked)."""
        row = self.table.alloc()
        req.row, req.kv_len, req.prefix_len, req.node = row, 0, 0, None
        if self.tree is not None:
            match = self.tree.match_prefix(req.tokens(0, req.seq_len - 1))
            if match.length:
                self.table.table[row, : match.length] = match.slots
            self.tree.inc_lock_ref(match.node)
            req.node, req.kv_len, req.prefix_len = match.node, match.length, match.length

    def reserve_row(self, req: Request) -> None:
        """A table row for a fork (`StepPlan.forks`), whose KV comes with `attach_forks` after the step."""
        req.row, req.kv_len, req.prefix_len, req.node = self.table.alloc(), 0, 0, None

    def attach_forks(self, reqs: list[Request]) -> list[Request]:
        """Point each fork's row at its whole prompt in the tree (its leader's chunk was just cached), pinned:
        one tree walk and one table write per distinct prompt. Returns the forks whose prompt the tree does
        not hold whole; their rows are given back."""
        assert self.tree is not None
        by_prompt: dict[int, list[Request]] = {}  # a group's samples share their prompt's list
        for req in reqs:
            by_prompt.setdefault(id(req.prompt_ids), []).append(req)
        failed: list[Request] = []
        for forks in by_prompt.values():
            prompt = forks[0].prompt_ids
            match = self.tree.match_prefix(prompt)
            if match.length < len(prompt):
                for req in forks:
                    self.table.free(req.row)
                    req.row = -1
                failed += forks
                continue
            rows = host_to_device(
                np.array([req.row for req in forks], dtype=np.int64), self.table.table.device
            )
            self.table.table[rows, : match.length] = match.slots
            for req in forks:
                self.tree.inc_lock_ref(match.node)
                req.node, req.kv_len, req.prefix_len = match.node, match.length, match.length
        return failed

    def alloc_extend(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """Slots for positions starts[i] .. starts[i] + lens[i] - 1 of the requests holding table rows
        `rows` (written into the table); returns them packed."""
        p = self.page_size
        count = len(rows)
        device = self.table.table.device
        flat_table, width = self.table.table.view(-1), self.table.max_context
        total = int(lens.sum())
        if total == count:  # one token each (decode): no per-token expansion
            tok_row, tok_pos = rows, starts
        else:
            tok_row = np.repeat(rows, lens)
            tok_pos = concat_ranges(starts, lens)
        at = tok_row * width + tok_pos  # each position's entry in the flattened table
        if p == 1:
            pages = self.pool.alloc_pages(total)  # int32, as the table holds them
            flat_table[host_to_device(at, device)] = pages
            return pages.long()
        # Positions inside a page the request already holds continue it; the others open new pages.
        new_pages = -(-(starts + lens) // p) - -(-starts // p)
        pages = self.pool.alloc_pages(int(new_pages.sum()))
        page_in_req = tok_pos // p
        first_new = np.repeat(-(-starts // p), lens)
        is_new = page_in_req >= first_new
        ordinal = np.repeat(np.cumsum(new_pages) - new_pages, lens) + page_in_req - first_new
        # One copy to the device for every per-token index (a step's small copies cost host time each).
        packed = np.stack([at, at - tok_pos % p, np.where(is_new, ordinal, 0), tok_pos % p, is_new])
        at_t, page_start, ordinal_t, offset, is_new_t = host_to_device(packed, device)
        base = flat_table[page_start]  # the slot starting the page, where the request holds it
        if pages.numel():
            base = torch.where(is_new_t.bool(), pages[ordinal_t] * p, base)
        slots = base + offset
        flat_table[at_t] = slots.to(torch.int32)
        return slots

    def truncate(self, cuts: list[tuple[Request, int]]) -> None:
        """Drop the keys and values of positions >= kv_len of each (request, kv_len) (rejected draft tokens);
        whole pages past the one holding position kv_len - 1 go back to the pool, in one call for all."""
        p = self.page_size
        rows, starts, counts = [], [], []
        for req, kv_len in cuts:
            keep = -(-kv_len // p) * p
            if req.kv_len > keep:
                rows.append(req.row)
                starts.append(keep)
                counts.append(-(-req.kv_len // p) - keep // p)  # the pages it holds past `keep`
            req.kv_len = kv_len
        if not rows:
            return
        # One slot per freed page: the first of each (page-aligned) page.
        first = concat_ranges(np.asarray(starts), np.asarray(counts), step=p)
        row_of = np.repeat(np.asarray(rows), counts)
        device = self.table.table.device
        slots = self.table.table[host_to_device(row_of, device), host_to_device(first, device)]
        self.pool.free_pages(slots.long() // p)

    def cache_unfinished(self, req: Request) -> None:
        """Put the request's computed prefix into the tree so others can share it (it stays pinned)."""
        if self.tree is None:
            return
        aligned = req.kv_len - req.kv_len % self.page_size
        if aligned <= req.prefix_len:
            return
        self._insert(req, aligned)

    def _insert(self, req: Request, aligned: int) -> None:
        assert self.tree is not None
        key = req.tokens(0, aligned)
        own = self.table.table[req.row, :aligned].clone()
        already = self.tree.insert(key, own)
        if already > req.prefix_len:
            self.pool.free_slots(own[req.prefix_len : already])
        match = self.tree.match_prefix(key)
        assert match.length == aligned, (match.length, aligned)
        self.table.table[req.row, req.prefix_len : aligned] = match.slots[req.prefix_len :]
        self.tree.inc_lock_ref(match.node)
        if req.node is not None:
            self.tree.dec_lock_ref(req.node)
        req.node, req.prefix_len = match.node, aligned

    def release(self, req: Request) -> None:
        """Give all of the request's KV back (into the tree when there is one) and free its row."""
        if req.row < 0:
            return
        row = self.table.table[req.row]
        if self.tree is not None:
            aligned = req.kv_len - req.kv_len % self.page_size
            if aligned > req.prefix_len:
                # As `_insert`, less what only a request that goes on needs: its row pointed at the tree's
                # slots and its lock moved to the new path (given back at once below).
                own = row[:aligned].clone()
                already = self.tree.insert_and_touch(req.tokens(0, aligned), own)
                if already > req.prefix_len:
                    self.pool.free_slots(own[req.prefix_len : already])
            if req.kv_len > aligned:
                self.pool.free_slots(row[aligned : req.kv_len])
            if req.node is not None:
                self.tree.dec_lock_ref(req.node)
        elif req.kv_len:
            self.pool.free_slots(row[: req.kv_len])
        self.table.free(req.row)
        req.row, req.kv_len, req.prefix_len, req.node = -1, 0, 0, None

    # MoE routing ---------------------------------------------------------------------------------
    def recorded_routing(self, req: Request) -> torch.Tensor | None:
        """Experts chosen at every position fed to the model (the prompt, then the response minus its last
        token), read from the pool's slot store (`rollout.record_routing`); the layout
        `Sample.routed_experts` documents for routing replay. None where it was not recorded or is lost."""
        if self.pool.routing is None or not req.output_ids:
            return None
        if req.row >= 0:
            fed = len(req.prompt_ids) + len(req.output_ids) - 1
            slots = self.table.table[req.row, :fed].long()
        else:
            # Retracted (preemption, `release_memory`) and ended while waiting (its max_new_tokens lowered
            # to its output): what it computed went into the radix cache, where it may still be.
            fed = len(req.prompt_ids) + min(len(req.output_ids), max(req.params.max_new_tokens, 1)) - 1
            match = self.tree.match_prefix(req.tokens(0, fed)) if self.tree is not None else None
            if match is None or match.length < fed:
                return None
            slots = match.slots[:fed].long()
        return self.pool.routing[slots].cpu()  # int16 [fed, moe layers, top_k]: compact, not nested lists
