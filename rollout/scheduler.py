"""Continuous batching: which tokens of which requests the next forward computes.

Every step: all decoding requests feed one token each; requests part-way through their prompt continue it
(chunked prefill); new requests are admitted while the token budget (`max_batch_tokens`), the running cap
and the KV pool allow. Admission is cache-aware: waiting requests with the longest cached prefix go first,
and a request whose prefix is being computed in this very step by another (the `n` samples of a group) waits
one step and then finds that prefix in the radix cache instead of computing it again; one whose whole prompt
another's chunk completes in this step (the other samples of a group) forks from it: it takes its first
token from that chunk's last logits row, and its prompt's KV from the cache once the chunk is committed, so a
group's samples decode in lockstep from their first token. When decoding
requests need slots that the pool (after evicting unlocked cache) does not have, the scheduler retracts
running requests (fewest generated tokens first); they re-enter the queue and later recompute their KV.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from miles.rollout.kv.manager import KVManager
from miles.rollout.request import Request

_CLIP_NEW_TOKENS = 4096
"""Cap on any one request's expected future tokens in the admission estimate."""


@dataclass(slots=True)
class Chunk:
    req: Request
    start: int
    length: int
    samples: bool = False
    """The chunk reaches the end of the sequence, so its last position yields the next token."""
    draft: tuple[int, ...] = ()
    """Speculative decoding: draft tokens fed after the sequence's last token; every row then samples."""

    @property
    def sample_rows(self) -> int:
        return (1 + len(self.draft)) if self.samples else 0

    @classmethod
    def of(cls, req: Request, length: int) -> Chunk:
        return cls(req, req.kv_len, length, req.kv_len + length == req.seq_len)


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    """Requests that can never run (too long for the pool), with the reason."""
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    """(request, leader): fresh requests with the same prompt as a leader whose chunk completes it in this
    step. They compute nothing: their first token is sampled from the leader's last logits row, and their
    prompt's KV is the leader's, shared through the radix cache (`KVManager.attach_forks`)."""
    plain_decode: bool = False
    """Every chunk feeds one running request's newest output token (no prompt token, no drafts, nothing
    admitted)."""
    stalled_waiting: bool = False
    """A waiting request was passed over because it cannot grow (its max_new_tokens was lowered to its output
    while it waited, after a retraction): the engine ends it instead of recomputing it first."""

    @functools.cached_property
    def is_decode(self) -> bool:
        """Read once the plan is complete (`Scheduler.schedule` does, at its end)."""
        return self.plain_decode or (
            bool(self.chunks) and all(c.samples and c.length == 1 + len(c.draft) for c in self.chunks)
        )

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass
class SchedulerConfig:
    max_batch_tokens: int
    max_running_requests: int
    cache_aware: bool = True
    lpm_max_queue: int = 512
    """Longest-prefix-match ordering only up to this queue length (it costs a tree walk per request)."""
    dedup_tokens: int = 32
    """Defer a request when this many more of its tokens (or half its new tokens) are computed in-batch."""
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVManager) -> None:
        self.cfg, self.kv = cfg, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retracted = 0
        self._planned = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def requeue(self, req: Request) -> None:
        """Put a running request that holds no KV back at the head of the queue."""
        self.running.remove(req)
        self.waiting.appendleft(req)

    def retract_all(self) -> list[Request]:
        """Give back every running request's KV and queue it again (in its running order, ahead of the rest)."""
        retracted = list(self.running)
        for req in reversed(retracted):
            self.kv.release(req)
            self.waiting.appendleft(req)
        self.running.clear()
        self.num_retracted += len(retracted)
        return retracted

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stalled(self) -> list[Request]:
        """Requests whose output already reached `max_new_tokens`, lowered in place on their params while
        they ran, with no token of theirs in flight: nothing is scheduled for them."""
        return [r for r in [*self.running, *self.waiting] if not r.can_grow and r.pending_index < 0]

    # the plan ------------------------------------------------------------------------------------
    def schedule(self, in_flight: bool = False) -> StepPlan:
        """The next step's chunks. `in_flight`: a launched step's tokens are not read yet (overlap
        scheduling); then nothing is retracted or failed, the plan is empty instead, and the engine reads
        those tokens first (a request retracted meanwhile would finish outside the running set)."""
        plan = StepPlan()
        self._planned = 0  # slots this step's chunks will take
        decoding = self._decoding()
        if any(r.draft for r in decoding) and self._decode_tokens(decoding) > self.cfg.max_batch_tokens:
            for r in self.running:  # before making room: drafts that cannot run must not evict cache
                r.draft = []
        room = self._make_room_for_decodes(plan, in_flight, decoding)
        if room is None:
            return plan  # nothing runs until the step in flight is read and its finished requests leave
        decoding, self._planned = room
        drafted = any(r.draft for r in decoding)
        if drafted:
            plan.chunks = [Chunk(r, r.kv_len, 1 + len(r.draft), True, tuple(r.draft)) for r in decoding]
            budget = self.cfg.max_batch_tokens - self._decode_tokens(decoding)
        else:
            plan.chunks = [Chunk(r, r.kv_len, 1, True) for r in decoding]
            budget = self.cfg.max_batch_tokens - len(decoding)
        in_batch: list[Request] = []
        prefilling = (
            [] if len(decoding) == len(self.running) else [r for r in self.running if not r.is_decoding]
        )
        for req in prefilling:  # chunked prefills in progress
            length = self._fit_chunk(req, budget)
            if length == 0:
                break
            plan.chunks.append(Chunk.of(req, length))
            in_batch.append(req)
            budget -= length
        self._admit(plan, budget, in_batch)
        if not plan.chunks and self.running and not in_flight and all(r.can_grow for r in self.running):
            self._unblock(plan)
        # A request without output yet whose chunked prefill stopped one token short "decodes" its last
        # prompt token: that one is a prefill.
        plan.plain_decode = (
            bool(decoding)
            and not drafted
            and len(plan.chunks) == len(decoding)
            and all(r.output_ids for r in decoding)
        )
        if plan.is_decode:
            self.new_token_ratio = max(
                self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay
            )
        return plan

    def _fit_chunk(self, req: Request, budget: int) -> int:
        """Largest prefill chunk (<= budget) of `req` whose slots can be made free; 0 if none."""
        length = min(req.seq_len - req.kv_len, budget)
        while length > 0:
            need = self.kv.pages_needed(req, length) * self.kv.page_size
            if self.kv.ensure_free(self._planned + need):
                self._planned += need
                return length
            length = min(length // 2, length - 1)
        return 0

    def _decoding(self) -> list[Request]:
        # With overlap scheduling a request whose last allowed token is still in flight is running but done.
        # (`is_decoding and can_grow`, spelled out: this runs over every running request every step.)
        return [
            r
            for r in self.running
            if r.row >= 0
            and r.kv_len == len(r.prompt_ids) + len(r.output_ids) - 1
            and r.params.max_new_tokens > len(r.output_ids)
        ]

    @staticmethod
    def _decode_tokens(decoding: list[Request]) -> int:
        """Tokens the decoding requests feed: one each, plus their drafts."""
        return len(decoding) + sum(len(r.draft) for r in decoding if r.draft)

    def _make_room_for_decodes(
        self, plan: StepPlan, in_flight: bool, decoding: list[Request]
    ) -> tuple[list[Request], int] | None:
        """Free a slot for every decoding request, retracting requests while the pool is short; returns the
        decoding requests and the slots they take.

        None (plan nothing, wait a step) when the pool is short while a step is in flight, or only until
        requests whose last token is in flight finish.
        """
        pages_needed, page_size = self.kv.pages_needed, self.kv.page_size
        while True:
            if page_size == 1:  # a slot per token
                needed = self._decode_tokens(decoding)
            else:
                needed = sum(pages_needed(r, 1 + len(r.draft)) for r in decoding) * page_size
            if self.kv.ensure_free(needed):
                return decoding, needed
            if any(r.draft for r in self.running):  # drafts are optional: drop them before retracting
                for r in self.running:
                    r.draft = []
                continue
            if in_flight or not all(r.can_grow for r in self.running):
                return None
            self.new_token_ratio = 1.0
            if len(self.running) == 1:  # alone and still short: the pool cannot hold this request
                self._fail(self.running[0], plan)
                return [], 0
            # The request that loses least work: fewest generated tokens, then longest prompt.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self._retract(victim, plan)
            decoding = self._decoding()

    def _retract(self, req: Request, plan: StepPlan) -> None:
        self.kv.release(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        plan.retracted.append(req)
        self.num_retracted += 1

    def _unblock(self, plan: StepPlan) -> None:
        """Only part-prefilled requests run and none can grow: keep the furthest along, retract the rest."""
        head = max(self.running, key=lambda r: r.kv_len)
        for req in [r for r in self.running if r is not head]:
            self._retract(req, plan)
        length = self._fit_chunk(head, self.cfg.max_batch_tokens)
        if length:
            plan.chunks.append(Chunk.of(head, length))
        else:
            self._fail(head, plan)

    def _fail(self, req: Request, plan: StepPlan) -> None:
        self.kv.release(req)
        self.remove(req)
        plan.failed.append((req, self._too_long_message(req)))

    def _too_long_message(self, req: Request) -> str:
        return (
            f"the KV pool cannot hold this request: it needs {req.seq_len} tokens and the pool holds "
            f"{self.kv.pool.capacity_tokens}; raise rollout.kv_cache_bytes (CPU) or rollout.kv_cache_fraction (GPU), "
            "or shorten the prompt / max_new_tokens"
        )

    def _expected_new_tokens(self, req: Request) -> float:
        """Slots `req` is expected to need before it finishes (SGLang's new-token ratio).

        A request that ignores EOS and has no stop condition will use every one of its tokens: reserving
        fewer admits requests that must later be retracted and recomputed.
        """
        # The context (or the pool's size) may end it first (`req.room`): a max_new_tokens past it must not
        # hold the pool.
        remaining = min(
            max(req.remaining_tokens, 0), max(req.room - len(req.output_ids), 0), _CLIP_NEW_TOKENS
        )
        p = req.params
        if p.ignore_eos and not p.stop_token_ids and not p.stop:
            return float(remaining)
        return remaining * self.new_token_ratio

    def _reserved_tokens(self) -> float:
        return sum(self._expected_new_tokens(r) for r in self.running)

    def _admit(self, plan: StepPlan, budget: int, in_batch: list[Request]) -> None:
        if not self.waiting or budget <= 0:
            return
        reserved = self._reserved_tokens()
        busy = bool(self.running or plan.chunks)
        if busy and self.kv.available_tokens() - reserved - self._planned < self.kv.page_size:
            return  # the pool is spoken for: skip the (per-request) prefix matching below
        candidates = list(self.waiting)
        lengths: dict[int, int] = {}
        if self.kv.tree is not None and self.cfg.cache_aware and len(candidates) <= self.cfg.lpm_max_queue:
            # One tree walk per prompt: a group's samples share their prompt's list (`Engine.generate`).
            by_prompt: dict[int, int] = {}
            for r in candidates:
                if r.output_ids:
                    lengths[r.rid] = self.kv.match_length(r)
                else:
                    key = id(r.prompt_ids)
                    if key not in by_prompt:
                        by_prompt[key] = self.kv.match_length(r)
                    lengths[r.rid] = by_prompt[key]
            candidates.sort(key=lambda r: -lengths[r.rid])  # stable: FCFS among equals
        admitted: list[Request] = []
        trie = _PrefixTrie()
        for other in in_batch:
            trie.insert(other.prompt_ids)
        leaders: dict[tuple[int, int, int], list[Request]] = {}
        for chunk in plan.chunks:
            self._note_leader(chunk, leaders)
        for req in candidates:
            if len(self.running) >= self.cfg.max_running_requests or self.kv.table.num_free == 0:
                break
            if req.abort_requested:
                continue
            if not req.can_grow:
                plan.stalled_waiting = True
                continue
            leader = _leader_of(req, leaders) if leaders else None
            if leader is not None:
                future = self._expected_new_tokens(req)
                if self.kv.available_tokens() - reserved - self._planned < future:
                    break
                self.kv.reserve_row(req)
                self.waiting.remove(req)
                self.running.append(req)
                plan.forks.append((req, leader))
                reserved += future
                continue
            if budget <= 0:
                if leaders:
                    continue  # later candidates may still fork, which costs no budget
                break
            if self.kv.tree is not None and in_batch:
                cached = lengths.get(req.rid)
                if cached is None:
                    cached = self.kv.match_length(req)
                shared = trie.longest(req.tokens(0, req.seq_len - 1))
                shared -= shared % self.kv.page_size  # the cache keeps whole pages: a partial one never comes
                if shared - cached >= min(self.cfg.dedup_tokens, max(1, (req.seq_len - cached) // 2)):
                    continue  # its prefix is being computed right now; take it from the cache next step
            self.kv.admit(req)
            length = min(req.seq_len - req.kv_len, budget)
            alone = not self.running and not admitted and not plan.chunks
            if alone:  # progress guarantee: the first request may take whatever fits
                length = self._fit_chunk(req, length)
                ok = length > 0
            else:
                need = self.kv.pages_needed(req, length) * self.kv.page_size
                future = self._expected_new_tokens(req)
                room = self.kv.available_tokens() - reserved - self._planned
                ok = room >= need + future and self.kv.ensure_free(self._planned + need)
                if ok:
                    self._planned += need
            if not ok:
                if alone:
                    self._fail(req, plan)
                    continue
                self.kv.release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(req)
            in_batch.append(req)
            trie.insert(req.prompt_ids)
            reserved += self._expected_new_tokens(req)
            chunk = Chunk.of(req, length)
            plan.chunks.append(chunk)
            budget -= length
            self._note_leader(chunk, leaders)

    def _can_lead(self, chunk: Chunk) -> bool:
        """Whether other samples of this chunk's prompt can fork from it: the chunk completes a fresh prompt,
        and the whole prompt goes into the radix cache when the step is committed (page-aligned length)."""
        req = chunk.req
        return (
            self.kv.tree is not None  # without the cache there is nothing to share the prompt's KV through
            and chunk.samples
            and not chunk.draft
            and not req.output_ids
            and len(req.prompt_ids) % self.kv.page_size == 0
        )

    def _note_leader(self, chunk: Chunk, leaders: dict[tuple[int, int, int], list[Request]]) -> None:
        if self._can_lead(chunk):
            leaders.setdefault(_prompt_key(chunk.req.prompt_ids), []).append(chunk.req)


def _prompt_key(ids: list[int]) -> tuple[int, int, int]:
    """A cheap key that equal prompts share (the lists are compared only on a match)."""
    return (len(ids), ids[0], ids[-1]) if ids else (0, -1, -1)


def _leader_of(req: Request, leaders: dict[tuple[int, int, int], list[Request]]) -> Request | None:
    if req.output_ids:  # a retracted request with output must recompute its own sequence
        return None
    for leader in leaders.get(_prompt_key(req.prompt_ids), ()):
        if leader.prompt_ids == req.prompt_ids:
            return leader
    return None


class _PrefixTrie:
    """Token trie of the prompts computed in this step (in-batch prefix sharing). Built on the first
    lookup: when every other sample of a group forks, nothing looks it up."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self._pending: list[list[int]] = []

    def insert(self, ids: list[int]) -> None:
        self._pending.append(ids)

    def longest(self, ids: list[int]) -> int:
        for pending in self._pending:
            node = self.root
            for t in pending:
                node = node.setdefault(t, {})
        self._pending.clear()
        node, n = self.root, 0
        for t in ids:
            node = node.get(t)  # type: ignore[assignment]
            if node is None:
                break
            n += 1
        return n
