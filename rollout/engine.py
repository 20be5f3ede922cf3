"""`Engine`: the embedded rollout engine — the RL loop's `generate`, on the shared `CausalLM`.

One step = schedule (scheduler.py) -> allocate KV slots (kv/manager.py) -> forward over the paged KV cache
(model_runner.py) -> sample with exact logprobs (sampling/) -> finish, cache and release requests.
`generate` adds a batch of requests and steps until they are all done; `add_request` / `step` / `abort`
expose the same loop one step at a time. With speculative decoding (spec/decoder.py) a step's requests
carry drafts, proposed before the step is planned and verified when its tokens are read.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.config import RolloutConfig
from miles.models.checkpoint import from_pretrained
from miles.models.draft_head import DraftHead
from miles.models.model import CausalLM
from miles.rollout.batching import build_batch
from miles.rollout.checks import check_rollout_config
from miles.rollout.components import build_engine_parts
from miles.rollout.forward_batch import ForwardBatch, host_to_device
from miles.rollout.outputs import finish_status, to_sample
from miles.rollout.prompts import prompt_problem, prompt_token_ids
from miles.rollout.request import Request
from miles.rollout.sampling.params import SamplingParams
from miles.rollout.sampling.sampler import derive_seed, prompt_key
from miles.rollout.scheduler import Chunk, StepPlan
from miles.rollout.spec.decoder import HeadState
from miles.rollout.stats import EngineStats
from miles.rollout.step_state import LaunchedStep, StepLoop, StepRun
from miles.rollout.weights import WeightsInput, load_weights
from miles.rollout.weights_region import WeightsRegion
from miles.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

_STALL_STEPS = 10_000
"""Steps without progress after which `generate` gives up (a scheduler bug, not a slow request)."""


def _await_token(req: Request, row: int) -> None:
    """A placeholder for the token that sample row `row` of the launched step gives `req` (`_resolve` puts
    it in place), unless the request finished meanwhile or gave its row back."""
    if not req.finished and req.row >= 0:
        req.output_ids.append(-1)
        req.logprobs.append(float("nan"))
        req.pending_index = row


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any | None,
        cfg: RolloutConfig,
        reserve_bytes: int = 0,
        draft_model: CausalLM | None = None,
        draft_head: DraftHead | None = None,
    ) -> None:
        """`reserve_bytes`: device memory that others will allocate later (a colocated trainer's optimizer
        state and gradients), left out of the free memory the KV pool takes its fraction of (GPU).
        `draft_model`: the model proposing drafts with `rollout.speculative=draft` (else loaded from
        `rollout.spec_draft_model`); `draft_head`: the head proposing them with `rollout.speculative=head`
        (else `rollout.spec_head`, or a new one)."""
        check_rollout_config(cfg, model.args.context_length)
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.args = model.args
        self.device, self.dtype = model.device, model.dtype
        model.eval()
        # Before the KV pool takes its share of the free memory, and before any graph captures the weights.
        self.weights_region = WeightsRegion(model) if cfg.release_weights_during_train else None
        parts = build_engine_parts(model, tokenizer, cfg, reserve_bytes, draft_model, draft_head)
        self.backend, self.pool, self.kv, self.runner = parts.backend, parts.pool, parts.kv, parts.runner
        self.scheduler, self.sampler, self.spec = parts.scheduler, parts.sampler, parts.spec
        self.max_context, self.max_seq_len = parts.max_context, parts.max_seq_len  # (`EngineParts` says what)
        self.eos_ids, self.overlap, self._groups = parts.eos_ids, parts.overlap, parts.prefix_groups
        self.loop = StepLoop()
        self.stats = EngineStats()
        self._weight_version = 0
        self._next_rid = 0
        self._seed_counter = 0
        self._requests: dict[int, Request] = {}
        self._results: dict[int, Sample] = {}
        self._newly_finished: list[int] | None = None
        """Request ids in the order they finished, while a `generate(on_finish=...)` call collects them."""
        self._prompt_texts: dict[int, str] = {}
        self._released = False
        self._outside_peak = self.bytes_outside_allocator
        self._weights_broken: str | None = None
        """Why the last `update_weights` failed part-way: the model holds some new tensors and some old."""
        self._alternative_requests = 0
        """Unfinished requests that asked for `top_logprobs`: while there are none, a step looks for none."""

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        cfg: RolloutConfig,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "auto",
    ) -> Engine:
        if str(device) == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = from_pretrained(path, dtype=dtype, device=device)
        tokenizer = None
        if any(
            (Path(path) / name).exists()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, cfg)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # public API ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[Sample] | list[list[int]] | list[str],
        params: SamplingParams,
        on_finish: Callable[[Sample], None] | None = None,
    ) -> list[Sample]:
        """`len(prompts) * params.n` samples, prompt-major; blocks until all are finished. `on_finish` is
        called with each sample as it finishes, between engine steps (e.g. to start scoring it); it must not
        call the engine. If it raises, the call's other requests are aborted and the exception propagates."""
        self._check_request(params)
        if on_finish is not None:
            return self._generate_reporting(prompts, params, on_finish)
        rids = self._enqueue_prompts(prompts, params)
        self._run_until_finished(rids)
        return [self._results.pop(rid) for rid in rids]

    def _generate_reporting(
        self,
        prompts: list[Sample] | list[list[int]] | list[str],
        params: SamplingParams,
        on_finish: Callable[[Sample], None],
    ) -> list[Sample]:
        self._newly_finished = []
        rids: list[int] = []
        try:
            rids = self._enqueue_prompts(prompts, params)
            mine = set(rids)
            self._run_until_finished(rids, lambda: self._report(mine, on_finish))
            self._report(mine, on_finish)
            return [self._results.pop(rid) for rid in rids]
        except BaseException:
            # An exception from on_finish (or the engine): the call's other requests end now, and none of its
            # results stays behind for a later call to find.
            self._newly_finished = None
            try:
                for rid in rids:
                    self.abort(rid)
                self._run_until_finished(rids)
            except Exception as cleanup:  # the engine itself failed: the original error is the one to see
                log.warning("could not abort the requests of a failed generate call: %s", cleanup)
            for rid in rids:
                self._results.pop(rid, None)
            raise
        finally:
            self._newly_finished = None

    def _report(self, mine: set[int], on_finish: Callable[[Sample], None]) -> None:
        finished, self._newly_finished = self._newly_finished or [], []
        for rid in finished:
            if rid in mine:
                on_finish(self._results[rid])

    def _enqueue_prompts(
        self, prompts: list[Sample] | list[list[int]] | list[str], params: SamplingParams
    ) -> list[int]:
        rids = []
        for position, prompt in enumerate(prompts):
            source = prompt if isinstance(prompt, Sample) else None
            # A new list, shared by the prompt's samples (never modified).
            ids = prompt_token_ids(prompt, self.tokenizer)
            error = self.validate_prompt(ids)
            group_id = source.group_id if source is not None else position
            text = prompt if isinstance(prompt, str) else None
            key = prompt_key(ids) if params.seed is not None else None  # once for the prompt's n samples
            for index in range(params.n):
                rids.append(self._enqueue(ids, error, params, group_id, index, source, text, key))
        return rids

    def _run_until_finished(self, rids: list[int], between_steps: Callable[[], None] | None = None) -> None:
        stalled = 0
        while any(rid not in self._results for rid in rids):
            if between_steps is not None:
                between_steps()
            progressed = bool(self.step()) or self.loop.progressed
            stalled = 0 if progressed else stalled + 1
            if stalled > _STALL_STEPS:
                raise RuntimeError("rollout engine made no progress (scheduler bug); please report it")

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        group_id: int = 0,
        index: int = 0,
        source: Sample | None = None,
        prompt_text: str | None = None,
    ) -> int:
        """Queue one sample's request; returns its id (its result comes out of `step`)."""
        self._check_request(params)
        prompt = [int(t) for t in prompt_ids]
        return self._enqueue(
            prompt, self.validate_prompt(prompt), params, group_id, index, source, prompt_text
        )

    def _check_request(self, params: SamplingParams) -> None:
        self._check_usable()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to Engine(...) or use stop_token_ids")
        if params.return_routing and self.args.moe_layer_ids and not self.cfg.record_routing:
            raise ValueError(
                "return_routing needs rollout.record_routing=true: the engine records the experts each token "
                "chose only then (it costs a store per KV slot and a write per step)"
            )

    def _enqueue(
        self,
        prompt: list[int],
        error: str | None,
        params: SamplingParams,
        group_id: int,
        index: int,
        source: Sample | None,
        prompt_text: str | None,
        key: int | None = None,
    ) -> int:
        """Add a request for `prompt` (its own list of ints, or one its group's samples share: no request
        modifies its prompt), finished at once with `error` (`validate_prompt`'s) if there is one. `key`:
        `prompt_key(prompt)` where the caller has it already."""
        rid = self._next_rid
        self._next_rid += 1
        if params.seed is not None:
            # The prompt's content too: with one seed for a whole batch (the RL loop's), different prompts
            # must not share random numbers, and the same prompt must draw the same wherever it sits.
            seed = derive_seed(params.seed, prompt_key(prompt) if key is None else key, index)
        else:
            seed = derive_seed(self.cfg.seed, self._seed_counter)
            self._seed_counter += 1
        req = Request(
            rid=rid,
            prompt_ids=prompt,
            params=params,
            seed=seed,
            group_id=group_id,
            index=index,
            source=source,
            end_ids=None
            if params.stop
            else frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_ids),
            room=self.max_seq_len - len(prompt),
        )
        self._requests[rid] = req
        self._alternative_requests += bool(params.top_logprobs)
        if prompt_text is not None:
            self._prompt_texts[rid] = prompt_text
        if error is not None:
            self._finish(req, SampleStatus.ABORTED, error)
        else:
            self.scheduler.add(req)
        return rid

    def abort(self, rid: int) -> None:
        """Stop a request at the next step; its result has status aborted and keeps what was generated."""
        req = self._requests.get(rid)
        if req is not None and not req.finished:
            req.abort_requested = True
            self.loop.abort_requested = True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.loop.in_flight is not None

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to draw as the interrupted one would: the counter unseeded requests'
        seeds come from (a judge reward sampling through the engine, say)."""
        return {"seed_counter": self._seed_counter}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._seed_counter = int(state["seed_counter"])

    def take_result(self, rid: int) -> Sample | None:
        return self._results.pop(rid, None)

    def partial_output(self, rid: int) -> list[int] | None:
        """The tokens a running request has generated so far (a token still on the device left out), for
        streaming; None once it finished (its result is then waiting in `take_result`) or if unknown."""
        req = self._requests.get(rid)
        return None if req is None or req.finished else req.known_output_ids

    # Inference mode, not just no_grad: tensors made in a step carry no autograd state at all, which makes
    # every op's dispatch cheaper (a decode step of the tiny CPU model: ~7 % faster). What a step creates
    # stays inside the engine's own steps (staging, plans, graphs); the pool, the table and the weights are
    # made outside and only written in place here, which inference mode allows.
    @torch.inference_mode()
    def step(self) -> list[Sample]:
        """Run one scheduling step; returns the samples that finished in it.

        With overlap scheduling (`rollout.overlap_schedule`, on by default on CUDA) a step plans and launches
        its forward while the device still runs the previous one, and only then reads the previous step's
        tokens: the host work of step t+1 hides behind the device work of step t. A request that the
        previous token finished (EOS, stop) has then already been given one more decode row, whose result is
        dropped. Without overlap the step reads its own tokens at once.
        """
        self._check_usable()
        loop = self.loop
        run = StepRun(started=time.perf_counter(), finished=loop.drained)
        loop.drained, loop.progressed = [], False
        self._before_plan(run)
        plan = self.scheduler.schedule(in_flight=loop.in_flight is not None)
        self._after_plan(plan, run)
        launched = self._launch(plan) if plan.chunks else None
        if launched is None and loop.in_flight is None:
            run.finished.extend(self._finish_stalled())
        if loop.in_flight is not None:
            loop.progressed = True
        run.finished.extend(self._resolve())
        if launched is not None:
            self._take_over(launched, plan, run)
        if not self.scheduler.has_work and loop.in_flight is None:
            self.sampler.forget()  # do not keep finished requests alive
        return run.finished

    def _before_plan(self, run: StepRun) -> None:
        """Aborts, requests left stalled by the last plan, and this step's drafts."""
        loop = self.loop
        if loop.abort_requested:
            run.finished.extend(self._resolve())  # an aborted result must not keep a placeholder token
            loop.abort_requested = False
            for req in [r for r in [*self.scheduler.waiting, *self.scheduler.running] if r.abort_requested]:
                run.finished.append(self._finish(req, SampleStatus.ABORTED, "aborted by the caller"))
        if loop.maybe_stalled:  # the last plan left a running request out: its limit may have been lowered
            run.finished.extend(self._finish_stalled())
        spec = self.spec
        if spec is None:
            return
        if spec.begin_step(self.stats):
            run.finished.extend(self._resolve())  # a plain step let through by the gate, overlapped
            drafting = time.perf_counter()
            spec.propose(self.stats, alternatives=self._alternative_requests > 0)
            self.stats.spec_draft_s += time.perf_counter() - drafting
            run.drafted = any(req.draft for req in self.scheduler.running)
        spec.mark(self.stats)

    def _after_plan(self, plan: StepPlan, run: StepRun) -> None:
        self.loop.maybe_stalled = plan.stalled_waiting or len(plan.chunks) < len(self.scheduler.running)
        self.stats.preemptions += len(plan.retracted)
        if plan.failed:
            run.finished.extend(self._resolve())
            for req, message in plan.failed:
                if not req.finished:
                    run.finished.append(self._finish(req, SampleStatus.ABORTED, message))

    def _take_over(self, launched: LaunchedStep, plan: StepPlan, run: StepRun) -> None:
        """The launched step becomes the one in flight (read at once without overlap, or when it verifies
        drafts: the next step's inputs depend on how many are kept); its time goes to the counters."""
        self._commit(launched)
        self.loop.in_flight = launched
        if not self.overlap or run.drafted:
            run.finished.extend(self._resolve())
        self.loop.progressed = True
        elapsed = time.perf_counter() - run.started
        if plan.is_decode and self.spec is not None:
            self.spec.record_decode_step(self.stats)
        self.stats.count_step(plan.is_decode, elapsed, launched.num_tokens, launched.kv_tokens)

    def _drain(self) -> None:
        """Read the step still in flight; samples it finishes are returned by the next `step()` too."""
        self.loop.drained.extend(self._resolve())

    # weights and memory ----------------------------------------------------------------------------
    def update_weights(self, weights: WeightsInput, version: int | None = None) -> None:
        """Load new weights (model names or HF names; a dict, (name, tensor) pairs, or buckets of either).

        Requests in flight are finished on the old weights first (update_policy=finish) or restarted from
        their prompt on the new ones (retract). The radix cache is flushed: its KV came from the old weights.
        While the KV memory is released (colocated training) nothing can run, so queued requests restart.
        """
        self._drain()
        if self.scheduler.has_work:
            if self.cfg.update_policy == "finish" and not self._released and self._weights_usable:
                while self.scheduler.has_work:
                    self.step()
            else:
                self.scheduler.retract_all()
                for req in self.scheduler.waiting:
                    self.stats.output_tokens -= len(req.output_ids)  # regenerated on the new weights
                    req.restart()
        self.flush_cache()
        if self.weights_region is not None:
            self.weights_region.check_writable()
        try:
            written = load_weights(self.model, weights)
        except BaseException as err:
            # The tensors before the bad one are in already: nothing may be generated from these weights.
            self._weights_broken = f"{type(err).__name__}: {err}"
            raise
        self._weights_broken = None
        if self.weights_region is not None:
            self.weights_region.mark_written(name for name, _ in written)
        if self.spec is not None:
            self.spec.new_weights()
        self._weight_version = self._weight_version + 1 if version is None else int(version)

    @property
    def draft_model(self) -> CausalLM | None:
        """The model proposing drafts (`rollout.speculative=draft`), else None."""
        drafter = self.spec.drafter if self.spec is not None else None
        return drafter.model if drafter is not None else None

    @property
    def draft_head(self) -> DraftHead | None:
        """The head proposing drafts (`rollout.speculative=head`), else None."""
        head_drafter = self.spec.head_drafter if self.spec is not None else None
        return head_drafter.head if head_drafter is not None else None

    def draft_weights_changed(self) -> None:
        """Drop the draft model's cached keys and values after its weights changed (trained in place): every
        request's sequence is fed to it again at its next proposal. The speculation gate measures the new
        draft's acceptance at the next decode step."""
        self._drain()
        if self.spec is not None:
            self.spec.draft_weights_changed()

    def flush_cache(self) -> None:
        """Empty the radix cache (no request may hold KV)."""
        self._drain()
        if self.scheduler.running:
            raise RuntimeError("flush_cache with requests running; retract or finish them first")
        if self.kv.tree is not None:
            self.kv.tree.reset(free=True)

    def release_memory(self) -> None:
        """Free the KV pool (colocated training); running requests are retracted and recomputed on resume."""
        if self._released:
            return
        self._drain()
        self.scheduler.retract_all()
        self.flush_cache()
        self.runner.release(keep_graphs=self.pool.keeps_addresses)
        self.pool.release()
        if self.spec is not None:
            self.spec.release()
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if not self._released:
            return
        if self.device.type == "cuda":  # the trainer's freed blocks, cached in pieces, make room for the pool
            torch.cuda.empty_cache()
        self.pool.allocate()
        if self.spec is not None:
            self.spec.resume()
        self._released = False
        self._outside_peak = max(self._outside_peak, self.bytes_outside_allocator)

    def release_weights(self) -> None:
        """Give the model's weights' memory back (`rollout.release_weights_during_train`: the engine's own
        copy, which the weight sync rewrites after each update); running requests are retracted."""
        if self.weights_region is None:
            raise RuntimeError(
                "release_weights needs an engine built with rollout.release_weights_during_train"
            )
        self._drain()
        self.scheduler.retract_all()
        self.flush_cache()
        self.weights_region.release()

    def resume_weights(self) -> None:
        """Memory behind the weights again, at their addresses (the CUDA graphs stay); the engine runs once
        `update_weights` wrote every parameter."""
        if self.weights_region is not None:
            self.weights_region.restore()
            self._outside_peak = max(self._outside_peak, self.bytes_outside_allocator)

    @property
    def _weights_usable(self) -> bool:
        return self.weights_region is None or self.weights_region.problem() is None

    @property
    def bytes_outside_allocator(self) -> int:
        """Device memory the engine holds outside torch's allocator: its reserved regions, where mapped."""
        weights = self.weights_region.mapped_bytes if self.weights_region is not None else 0
        return self.pool.bytes_outside_allocator + weights

    def outside_allocator_peak(self) -> int:
        """The most `bytes_outside_allocator` since the last call (the loop's per-phase memory peaks)."""
        peak, self._outside_peak = self._outside_peak, self.bytes_outside_allocator
        return max(peak, self._outside_peak)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """rollout/* metrics over the window since the last reset."""
        used = self.kv.used_tokens() if not self._released else 0
        out = self.stats.metrics(used, self.pool.capacity_tokens, self._weight_version)
        if reset:
            self.stats = EngineStats(peak_used_tokens=used)
        return out

    # internals -----------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError("the engine's KV memory is released; call engine.resume_memory() first")
        if self.weights_region is not None and (problem := self.weights_region.problem()) is not None:
            raise RuntimeError(problem)
        if self._weights_broken is not None:
            raise RuntimeError(
                f"the last update_weights failed part-way ({self._weights_broken}), leaving the model with some "
                "new and some old weights; call update_weights again with a whole set before generating"
            )

    def validate_prompt(self, ids: list[int]) -> str | None:
        """Why the engine would refuse a prompt (`prompts.prompt_problem`); None: it takes it."""
        return prompt_problem(ids, self.args.vocab_size, self.max_context, self.pool.capacity_tokens)

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the forward and sampling of the plan's chunks (and of its forks, which sample their leaders'
        last logits rows); nothing here waits for the device. A plain-decode plan (every chunk a running
        request's next token, `StepPlan.plain_decode`) skips the per-chunk accounting of prompt tokens."""
        s, chunks, forks = self.stats, plan.chunks, plan.forks
        if plan.plain_decode:  # admitted when their prompts ran; nothing goes into the radix cache
            extend = [False] * len(chunks)
            batch = self._build_batch(chunks, plain_decode=True)
            s.decode_tokens += len(chunks)
        else:
            extend = []
            for c in chunks:
                req = c.req
                if not req.admitted:
                    self._count_admission(req, c.start)
                computes_prompt = c.start < req.seq_len - 1 or not req.output_ids
                extend.append(computes_prompt)
                if computes_prompt:
                    s.prefill_tokens += c.length
                else:
                    s.decode_tokens += c.length
            batch = self._build_batch(chunks)
        s.peak_used_tokens = max(s.peak_used_tokens, self.kv.used_tokens())
        logits, routing = self.runner.forward(batch)
        hidden = self.runner.last_hidden if self.spec is not None and self.spec.wants_hidden else None
        if routing is not None and self.pool.routing is not None:
            self.pool.routing[batch.out_slots] = (
                routing[:, : batch.num_tokens].permute(1, 0, 2).to(torch.int16)
            )
        for c in chunks:
            c.req.inflight_tokens = c.length
        sampled = chunks if plan.plain_decode else [c for c in chunks if c.samples]
        fork_reqs = [req for req, _ in forks]
        step = LaunchedStep(
            chunks, extend, sampled, fork_reqs, num_tokens=batch.num_tokens, kv_tokens=sum(batch.kv_lens)
        )
        if not sampled:
            step.hidden = hidden
            return step
        if plan.plain_decode:
            reqs, offsets = [c.req for c in chunks], None
        else:
            reqs = [c.req for c in sampled for _ in range(c.sample_rows)]
            offsets = np.fromiter((j for c in sampled for j in range(c.sample_rows)), np.uint64, len(reqs))
        if forks:
            first_row, row = {}, 0
            for c in sampled:
                first_row[c.req.rid] = row
                row += c.sample_rows
            leader_rows = [first_row[leader.rid] for _, leader in forks]
            leaders = host_to_device(torch.tensor(leader_rows), self.device)
            logits = torch.cat((logits, logits[leaders]))
            if hidden is not None:
                hidden = torch.cat((hidden, hidden[leaders]))
            sampled = sampled + [Chunk(req, len(req.prompt_ids), 0, True) for req in fork_reqs]
            reqs = reqs + fork_reqs
            if offsets is not None:
                offsets = np.concatenate((offsets, np.zeros(len(fork_reqs), np.uint64)))
        tokens, logprobs, st = self.sampler.sample(logits, reqs, offsets)
        step.sampled, step.hidden = sampled, hidden
        alternatives = self.sampler.alternatives(logits, reqs) if self._alternative_requests else None
        step.keep_results(tokens, logprobs, alternatives)
        if self.spec is not None:  # behind the tokens' copy
            step.chained = self.spec.chain(batch, sampled, forks, hidden, tokens, st)
        return step

    def _build_batch(self, chunks: list[Chunk], plain_decode: bool = False) -> ForwardBatch:
        batch = build_batch(chunks, self.kv, self.device, self._groups, plain_decode)
        in_flight = self.loop.in_flight
        if in_flight is not None and in_flight.tokens is not None:
            # Tokens still on the device (placeholders -1): gather them from the step in flight.
            where, pending, offset = [], [], 0
            for c in chunks:
                req = c.req
                if req.pending_index >= 0 and c.start <= req.seq_len - 1 < c.start + c.length:
                    where.append(offset + req.seq_len - 1 - c.start)
                    pending.append(req.pending_index)
                offset += c.length
            if where:
                index, source = host_to_device(np.array([where, pending], dtype=np.int64), self.device)
                batch.input_ids[index] = in_flight.tokens[source]
        return batch

    def _count_admission(self, req: Request, cached: int) -> None:
        """A request's first chunk (or attached fork), starting at position `cached`: the prompt and
        cache-hit counters."""
        s = self.stats
        req.admitted = True
        req.cached_tokens = cached
        s.requests += 1
        s.prompt_tokens += len(req.prompt_ids)
        s.cached_prompt_tokens += min(cached, len(req.prompt_ids))

    def _commit(self, step: LaunchedStep) -> None:
        """Host bookkeeping of a launched step: KV lengths, placeholder tokens, radix-cache inserts."""
        row = 0  # the next sampling chunk's first sample row (`step.sampled`: these chunks, then the forks)
        for c, computes_prompt in zip(step.chunks, step.extend):
            req = c.req
            req.kv_len += req.inflight_tokens  # 0 for a request `_finish` already settled
            req.inflight_tokens = 0
            if computes_prompt and not req.finished:
                self.kv.cache_unfinished(req)
            if c.samples:
                _await_token(req, row)
                row += 1 + len(c.draft)
        # After the leaders' prompts went into the cache. Not expected to fail (the leader's whole-page prompt
        # was just inserted and is pinned); a fork that does computes its prompt itself later.
        failed = set(self.kv.attach_forks(step.forks)) if step.forks else ()
        for req in step.forks:
            if req in failed:
                self.scheduler.requeue(req)
            else:
                if not req.admitted:
                    self._count_admission(req, len(req.prompt_ids))
                _await_token(req, row)
            row += 1

    def _finish_stalled(self) -> list[Sample]:
        """Requests whose max_new_tokens was lowered in place to their output while they ran end here instead
        of waiting for ever (`_finish` cuts them to the new limit)."""
        return [self._finish(req, SampleStatus.TRUNCATED) for req in self.scheduler.stalled()]

    def _resolve(self) -> list[Sample]:
        """Wait for the step in flight, put its tokens in place of the placeholders, finish requests."""
        step, self.loop.in_flight = self.loop.in_flight, None
        if step is None or step.host is None:
            return []
        read = step.read()
        self.stats.device_wait_s += read.waited_s
        tokens, logprobs, alternatives = read.tokens, read.logprobs, read.alternatives
        finished: list[Sample] = []
        cuts: list[tuple[Request, int]] = []
        row = plain = 0
        eos_ids, max_context, tokenizer = self.eos_ids, self.max_seq_len, self.tokenizer
        pending = SampleStatus.PENDING
        head_rows: dict[int, int] | None = {} if step.hidden is not None else None
        for c in step.sampled:
            req, first = c.req, row
            row += 1 + len(c.draft)  # its sample rows
            if req.status != pending or req.pending_index != first:
                self.stats.dropped_rows += 1  # finished before this row's token was read
                continue
            req.pending_index = -1
            before = len(req.output_ids)  # with the placeholder
            if c.draft:
                assert self.spec is not None
                status = self.spec.accept(
                    req, c.draft, tokens[first:row], logprobs[first:row], cuts, self.stats
                )
            else:
                token = int(tokens[first])
                req.output_ids[-1], req.logprobs[-1] = token, logprobs[first]
                if first in alternatives:
                    ids, values = alternatives[first]
                    req.alternatives[len(req.output_ids) - 1] = [
                        (int(t), v) for t, v in zip(ids[: req.params.top_logprobs], values) if v > -math.inf
                    ]
                plain += 1
                # The full check only where the token or the length may end the request (`Request.end_ids`).
                ends, length = req.end_ids, len(req.output_ids)
                if ends is None or token in ends or length >= req.params.max_new_tokens or length >= req.room:
                    status = finish_status(req, eos_ids, max_context, tokenizer)
                else:
                    status = None
            if status is not None:
                finished.append(self._finish(req, status))
            elif head_rows is not None:  # the row its last kept token was sampled from
                head_rows[req.rid] = first + len(req.output_ids) - before
        if head_rows is not None and self.spec is not None:
            self.spec.head_state = HeadState(head_rows, step.hidden, step.chained)
        self.stats.output_tokens += plain
        self.kv.truncate(cuts)
        return finished

    def _finish(self, req: Request, status: SampleStatus, error: str | None = None) -> Sample:
        if req.params.top_logprobs and not req.finished:
            self._alternative_requests -= 1
        # Finished while its next step is queued (overlap): that step's KV slots are the request's too.
        req.kv_len += req.inflight_tokens
        req.inflight_tokens = 0
        routed = self.kv.recorded_routing(req) if req.params.return_routing else None
        if routed is None and req.params.return_routing and req.output_ids and status != SampleStatus.ABORTED:
            # Without it the trainer's routing replay could not use the sample: it costs the sample, not the run.
            status = SampleStatus.ABORTED
            error = "its recorded MoE routing was lost (retracted while its KV left the cache)"
        self.kv.release(req)  # all it computed: those keys and values are right, whatever is returned
        if self.spec is not None:
            self.spec.forget(req.rid)
        self.scheduler.remove(req)
        limit = req.params.max_new_tokens
        if len(req.output_ids) > limit:
            # max_new_tokens was lowered in place while it ran: return what it would have under that limit
            # from the start (the tokens do not depend on the limit), which ends on the limit.
            # (A token still in flight is a placeholder, not counted yet.)
            self.stats.output_tokens -= max(0, len(req.output_ids) - limit - (req.pending_index >= 0))
            del req.output_ids[limit:], req.logprobs[limit:]
            req.stop_text = None  # found in tokens past the limit
            if routed is not None:
                routed = routed[: len(req.prompt_ids) + max(limit, 1) - 1]
            if status != SampleStatus.ABORTED:
                status = SampleStatus.TRUNCATED
        req.status, req.error = status, error
        self.stats.aborted += status == SampleStatus.ABORTED
        self.stats.truncated += status == SampleStatus.TRUNCATED
        prompt_text = self._prompt_texts.pop(req.rid, "")
        sample = to_sample(req, self.tokenizer, self._weight_version, prompt_text, routed)
        self._results[req.rid] = sample
        if self._newly_finished is not None:
            self._newly_finished.append(req.rid)
        del self._requests[req.rid]
        return sample
