"""`SpecDecoder`: the engine's side of speculative decoding (`rollout.speculative`), exact.

Before a decode step is planned, every running request that may grow gets a draft (`propose`): tokens the
n-grams of its own sequence, a draft model (draft_model.py) or a draft head (head.py) expect to follow. The
step then feeds each request its last token and its draft, and samples every row as plain decoding would
at that position; `accept` keeps the sampled tokens up to the first that differs from its draft, so the
kept tokens are exactly plain decoding's. The gate (gate.py) lets decode steps run plain while too few
drafts are kept for speculation to pay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from miles.config import RolloutConfig
from miles.rollout.forward_batch import ForwardBatch
from miles.rollout.kv.manager import KVManager
from miles.rollout.outputs import finish_status
from miles.rollout.request import Request
from miles.rollout.sampling.sampler import SamplingTensors
from miles.rollout.scheduler import Chunk, Scheduler
from miles.rollout.spec.draft_model import DraftModel
from miles.rollout.spec.gate import SpecGate
from miles.rollout.spec.head import ChainedDrafts, DraftHeadProposer
from miles.rollout.spec.ngram import NgramIndex
from miles.rollout.stats import EngineStats
from miles.sample import SampleStatus

log = logging.getLogger(__name__)


class Wanted(NamedTuple):
    """A request to draft for this step, and how many tokens."""

    req: Request
    k: int


@dataclass
class HeadState:
    """What the draft head's next proposal starts from: the last resolved step's sample rows."""

    rows: dict[int, int] = field(default_factory=dict)
    """Request id -> the row of `hidden` its last kept token was sampled from (the last step's requests)."""
    hidden: torch.Tensor | None = None
    """The last resolved step's sample rows' hidden states (`LaunchedStep.hidden`)."""
    chained: ChainedDrafts | None = None
    """The last resolved step's chained drafts (`LaunchedStep.chained`), for the next proposal."""


@dataclass
class _Counts:
    """The engine's spec counters before a step's verify chunks are read (the gate records the step's own)."""

    verified: int = 0
    accepted: int = 0


class SpecDecoder:
    def __init__(
        self,
        cfg: RolloutConfig,
        scheduler: Scheduler,
        kv: KVManager,
        verify_batch_limit: int,
        eos_ids: set[int],
        max_seq_len: int,
        tokenizer: Any | None,
        drafter: DraftModel | None = None,
        head_drafter: DraftHeadProposer | None = None,
    ) -> None:
        """`verify_batch_limit`: the largest batch whose verify steps replay a CUDA graph (cuda_graph.py); 0
        where verify steps run eagerly at any size. `drafter` / `head_drafter`: the draft model or head that
        proposes (neither: n-gram lookup). `eos_ids`, `max_seq_len`, `tokenizer`: what ends a request
        (outputs.finish_status)."""
        self.cfg, self.scheduler, self.kv = cfg, scheduler, kv
        self.verify_batch_limit = verify_batch_limit
        self.eos_ids, self.max_seq_len, self.tokenizer = eos_ids, max_seq_len, tokenizer
        self.drafter, self.head_drafter = drafter, head_drafter
        self.gate = SpecGate(cfg.spec_min_accept_length, cfg.spec_probe_every)
        self.head_state = HeadState()
        self._counts = _Counts()
        self._warned_oom = False

    # a step -------------------------------------------------------------------------------------------
    def begin_step(self, stats: EngineStats) -> bool:
        """Before a step is planned: whether it speculates. Every step, drafting or not, drops the draft KV of
        requests that left; a step the gate keeps plain clears the drafts and counts as gated."""
        running = self.scheduler.running
        if self.drafter is not None:
            self.drafter.retain({req.rid for req in running})
        if self.gate.speculate():
            return True
        for req in running:
            req.draft = []
        stats.spec_gated_steps += 1
        return False

    def mark(self, stats: EngineStats) -> None:
        """The spec counters before the step's verify chunks are read, for `record_decode_step`."""
        self._counts = _Counts(stats.spec_steps, stats.spec_accepted_tokens)

    def record_decode_step(self, stats: EngineStats) -> None:
        """A decode step ran: the gate learns how many requests verified drafts and how many it kept."""
        self.gate.record(
            stats.spec_steps - self._counts.verified, stats.spec_accepted_tokens - self._counts.accepted
        )

    def propose(self, stats: EngineStats, alternatives: bool) -> None:
        """Set `req.draft` of the running requests (empty: none). `alternatives`: some unfinished request
        asked for `top_logprobs` (its rows get no drafts)."""
        cfg = self.cfg
        graph_limit = self.verify_batch_limit
        if graph_limit:
            # Graph verify (cuda_graph.py): a step drafts exactly spec_draft_tokens for every running request,
            # padded with filler tokens where the n-grams propose fewer (any draft is exact: a wrong one is
            # only rejected), or drafts nothing; a step that could not replay a verify graph (mixed with
            # prefills, too large, a request too near its end for a full draft) would run eagerly, which costs
            # far more than speculation saves.
            running, k = self.scheduler.running, cfg.spec_draft_tokens
            for req in running:
                req.draft = []
            if (
                self.scheduler.waiting
                or not running
                or len(running) > graph_limit
                or (alternatives and any(r.params.top_logprobs for r in running))
            ):
                return
            room = self.kv.table.max_context  # positions a request's KV may take: the context's or the pool's
            if not all(
                r.is_decoding and r.output_ids and min(r.remaining_tokens - 1, room - r.seq_len) >= k
                for r in running
            ):
                return
        running = self.scheduler.running
        wanted: list[Wanted] = []
        for req in running:
            req.draft = []
            # Not before the first output token: the chunk that ends the prompt is a prefill (it goes into
            # the radix cache, which must never hold draft positions).
            # A request that wants alternatives gets none for draft rows (the engine reads them per plain row).
            if not (req.is_decoding and req.can_grow and req.output_ids) or req.params.top_logprobs:
                continue
            # Bounded so that the kept tokens never pass max_new_tokens or the context, and so that the verify
            # chunk's KV (the sequence and its k drafts) fits the request's table row: min(context, pool).
            k = min(cfg.spec_draft_tokens, req.remaining_tokens - 1, self.kv.table.max_context - req.seq_len)
            if k > 0:
                wanted.append(Wanted(req, k))
        wanted = self._runnable(wanted, graph_limit > 0)
        if self.drafter is not None:
            for (req, _), draft in zip(wanted, self._draft_model_proposals(wanted)):
                req.draft = draft
        elif self.head_drafter is not None:
            self.head_proposals(wanted, stats)
        else:
            for req, k in wanted:
                index = req.ngram
                if index is None or len(index.tokens) > req.seq_len:  # new, or its output was reset
                    index = req.ngram = NgramIndex(cfg.spec_ngram_max, cfg.spec_ngram_min)
                    index.extend(req.prompt_ids)
                index.extend(req.output_ids[len(index.tokens) - len(req.prompt_ids) :])
                req.draft = index.propose(k)
        proposed = False
        for req, k in wanted:
            req.draft_proposed = len(req.draft)
            proposed = proposed or bool(req.draft)
            if graph_limit:
                req.draft += [(req.draft or req.output_ids)[-1]] * (k - len(req.draft))
        if graph_limit and not proposed:  # filler tokens alone: a verify step would likely keep one token
            for req in running:
                req.draft = []

    def _draft_model_proposals(self, wanted: list[Wanted]) -> list[list[int]]:
        """The draft model's drafts for `wanted`; none for anyone when it runs out of device memory: drafts
        are optional, so that costs this step's drafts and the draft's cached keys and values, not the run."""
        assert self.drafter is not None
        try:
            return self.drafter.propose([w.req for w in wanted], [w.k for w in wanted])
        except torch.cuda.OutOfMemoryError as err:
            if not self._warned_oom:
                log.warning(
                    "the draft model ran out of device memory (%s); this step decodes without drafts. "
                    "Lower rollout.kv_cache_fraction if it recurs",
                    str(err).split(". ")[0],
                )
                self._warned_oom = True
            self.drafter.retain(set())
            if self.kv.pool.device.type == "cuda":
                torch.cuda.empty_cache()
            return [[] for _ in wanted]

    def head_proposals(self, wanted: list[Wanted], stats: EngineStats) -> None:
        """The draft head's drafts, for the requests of `wanted` that were in the last step (the others have
        no hidden state to start from); none when it runs out of device memory."""
        assert self.head_drafter is not None
        state = self.head_state
        chained, state.chained = state.chained, None
        if chained is not None:  # drafts proposed behind the last (verify) step, where they follow on
            proposed, rest = chained.read(), []
            for req, k in wanted:
                length, draft = proposed.get(req.rid, (-1, []))
                if length == len(req.output_ids) and len(draft) >= k:
                    req.draft = draft[:k]
                else:
                    rest.append(Wanted(req, k))
            stats.spec_chained_drafts += len(wanted) - len(rest)
            wanted = rest
        picked = [w for w in wanted if w.req.rid in state.rows]
        if not picked or state.hidden is None:
            return
        try:
            drafts = self.head_drafter.propose(
                [w.req for w in picked],
                [w.k for w in picked],
                state.hidden,
                [state.rows[w.req.rid] for w in picked],
            )
        except torch.cuda.OutOfMemoryError as err:
            if not self._warned_oom:
                log.warning(
                    "the draft head ran out of device memory (%s); this step decodes without drafts",
                    str(err).split(". ")[0],
                )
                self._warned_oom = True
            if self.kv.pool.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        for (req, _), draft in zip(picked, drafts):
            req.draft = draft

    def _runnable(self, wanted: list[Wanted], uniform: bool) -> list[Wanted]:
        """The drafts the next step can verify. The scheduler drops every draft of a step whose decode rows
        pass the token budget or the free KV (scheduler.py), which would waste a draft model's work: so the
        last requests' drafts are left out until the rest fit, or all of them where verify steps must be
        uniform (`uniform`, verify graphs). While requests wait to be admitted (or prefilled), drafts take
        at most half of the budget decoding leaves, so that admission goes on."""
        running = self.scheduler.running
        decoding = sum(1 for r in running if r.is_decoding)
        rows = decoding + sum(w.k for w in wanted)
        budget = self.cfg.max_batch_tokens
        if self.scheduler.waiting or decoding < len(running):
            budget = decoding + max(0, budget - decoding) // 2
        room = min(budget, self.kv.available_tokens() - self.cfg.page_size * len(wanted))
        if rows <= room:
            return wanted
        if uniform:
            return []
        kept = list(wanted)
        while kept and rows > room:
            rows -= kept.pop().k
        return kept

    # a verify step's results --------------------------------------------------------------------------
    @property
    def wants_hidden(self) -> bool:
        """Whether a step keeps its sample rows' hidden states (the draft head starts from them)."""
        return self.head_drafter is not None

    def chain(
        self,
        batch: ForwardBatch,
        sampled: list[Chunk],
        forks: list[tuple[Request, Request]],
        hidden: torch.Tensor | None,
        tokens: torch.Tensor,
        st: SamplingTensors,
    ) -> ChainedDrafts | None:
        """The draft head's next proposal, chained behind a verify step whose requests all verified drafts
        of one length (head.py); None for other steps."""
        if self.head_drafter is None or hidden is None or not batch.verify_len or forks:
            return None
        reqs = [c.req for c in sampled]
        return self.head_drafter.chain(hidden, tokens, batch.input_ids, reqs, st, self.cfg.spec_draft_tokens)

    def accept(
        self,
        req: Request,
        draft: tuple[int, ...],
        tokens: list[float],
        logprobs: list[float],
        cuts: list[tuple[Request, int]],
        stats: EngineStats,
    ) -> SampleStatus | None:
        """Keep the sampled tokens of a verify chunk up to the first that differs from its draft.

        Row j sampled position L + j as if drafts 1..j were the sequence; that holds while they match what was
        sampled, so the kept tokens are exactly plain decoding's (an accepted draft has probability p(token)).
        Keys and values computed for rejected drafts are cut off: at once when the request finishes (its KV
        goes back next), else through `cuts`, done for all requests of the step together.
        """
        req.output_ids.pop()  # the placeholder
        req.logprobs.pop()
        base = req.seq_len - 1  # KV was valid up to here before the step
        status, kept, accepted = None, 0, 0
        for j, (token, logprob) in enumerate(zip(tokens, logprobs)):
            req.output_ids.append(int(token))
            req.logprobs.append(float(logprob))
            kept += 1
            status = finish_status(req, self.eos_ids, self.max_seq_len, self.tokenizer)
            matched = j < len(draft) and int(token) == draft[j]
            accepted += matched
            if status is not None or not matched:
                break
        if status is None:
            cuts.append((req, base + kept))
        else:
            self.kv.truncate([(req, base + kept)])
        req.spec_steps += 1
        req.spec_draft_tokens += len(draft)
        req.spec_proposed_tokens += req.draft_proposed
        req.spec_accepted_tokens += accepted
        stats.output_tokens += kept
        stats.spec_steps += 1
        stats.spec_draft_tokens += len(draft)
        stats.spec_proposed_tokens += req.draft_proposed
        stats.spec_accepted_tokens += accepted
        return status

    # the engine's life --------------------------------------------------------------------------------
    def forget(self, rid: int) -> None:
        """A request finished: its draft KV goes."""
        if self.drafter is not None:
            self.drafter.forget(rid)

    def new_weights(self) -> None:
        """The policy's weights changed: the head's starting rows came from the old ones, and the drafts'
        acceptance is measured again."""
        self.head_state = HeadState()
        self.gate.reset()

    def draft_weights_changed(self) -> None:
        """The draft model's weights changed (trained in place): its cached keys and values go, and the gate
        measures the new draft's acceptance at the next decode step."""
        if self.drafter is not None:
            self.drafter.retain(set())
        self.gate.reset()

    def release(self) -> None:
        """The KV memory is released: the draft's pool too; retracted requests start again from their
        prefill, so the head has nothing to start from."""
        if self.drafter is not None:
            self.drafter.release()
        self.head_state = HeadState()

    def resume(self) -> None:
        if self.drafter is not None:
            self.drafter.resume()
