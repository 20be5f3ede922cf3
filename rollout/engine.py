"""`Engine`: the embedded rollout engine — the RL loop's `generate`, on the shared `CausalLM`.

One step = schedule (scheduler.py) -> allocate KV slots (kv_manager.py) -> forward over the paged KV cache
(model_runner.py) -> sample with exact logprobs (sampling.py) -> finish, cache and release requests.
`generate` adds a batch of requests and steps until they are all done; `add_request` / `step` / `abort`
expose the same loop one step at a time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from miles.config import RolloutConfig
from miles.models import fused
from miles.models.checkpoint import from_pretrained
from miles.models.draft_head import DraftHead
from miles.models.model import CausalLM
from miles.rollout import virtual_memory
from miles.rollout.attention_flashinfer import check_decode_kernel
from miles.rollout.draft_head import ChainedDrafts, DraftHeadProposer, load_head, proposal_graphs
from miles.rollout.draft_model import DraftModel, load_draft_model
from miles.rollout.forward_batch import ForwardBatch, concat_ranges, host_to_device
from miles.rollout.kv_manager import KVManager
from miles.rollout.kv_pool import KVLayout, KVPool, RequestTable
from miles.rollout.model_runner import ModelRunner, resolve_backend
from miles.rollout.ngram import NgramIndex
from miles.rollout.outputs import finish_status, to_sample
from miles.rollout.params import SamplingParams
from miles.rollout.radix_cache import RadixCache
from miles.rollout.request import Request
from miles.rollout.sampler_graph import sample_rows
from miles.rollout.sampling import (
    SamplingTensors,
    derive_seed,
    mix_seeds,
    prompt_key,
    sample,
    top_alternatives,
    uniforms_of_mixed,
)
from miles.rollout.scheduler import Chunk, Scheduler, SchedulerConfig
from miles.rollout.spec_gate import SpecGate
from miles.rollout.weights import WeightsInput, load_weights
from miles.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

_DET_CHUNK_CPU, _DET_CHUNK_GPU = 16, 256
"""Fixed token-chunk size of deterministic mode (every matmul sees this many rows)."""
_STALL_STEPS = 10_000

_Settings = tuple[float, int, float, float]


def _await_token(req: Request, row: int) -> None:
    """A placeholder for the token that sample row `row` of the launched step gives `req` (`_resolve` puts
    it in place), unless the request finished meanwhile or gave its row back."""
    if not req.finished and req.row >= 0:
        req.output_ids.append(-1)
        req.logprobs.append(float("nan"))
        req.pending_index = row


def _settings(p: SamplingParams) -> _Settings:
    """What of a request's params its sampling row needs."""
    return (p.temperature, p.top_k, p.top_p, p.min_p)


@dataclass
class EngineStats:
    output_tokens: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of first admissions (the hit-rate denominator)."""
    cached_prompt_tokens: int = 0
    """Of those, found in the radix cache."""
    prefill_tokens: int = 0
    """Tokens computed in prefill / extend chunks (recomputation after preemption included)."""
    decode_tokens: int = 0
    preemptions: int = 0
    requests: int = 0
    aborted: int = 0
    truncated: int = 0
    steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    """Wall time of steps that computed any prefill chunk."""
    decode_s: float = 0.0
    """Wall time of pure decode steps."""
    decode_step_tokens: int = 0
    """Tokens computed in pure decode steps (`decode_tokens` also counts the decode rows of mixed steps,
    whose time is in `prefill_s`): with `decode_s` and `decode_kv_tokens`, the decode rate and roofline."""
    decode_kv_tokens: int = 0
    """Sum over decode steps of the tokens attended (for the decode roofline)."""
    peak_used_tokens: int = 0
    dropped_rows: int = 0
    """Overlap scheduling: decode rows computed for requests their previous token had already finished."""
    spec_steps: int = 0
    """Speculative decoding: request-steps that verified a draft, draft tokens (filler included), those the
    n-grams proposed, and those accepted."""
    spec_draft_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_s: float = 0.0
    """Wall time spent proposing drafts (the draft model's forwards and draws, or the n-gram lookups; a
    draft head's proposals chained behind verify steps are in those steps' time)."""
    spec_gated_steps: int = 0
    """Steps that ran plain because the drafts kept too few tokens (`rollout.spec_min_accept_length`)."""
    spec_chained_drafts: int = 0
    """Request-steps whose draft head proposal was chained on the device behind the verify step before."""
    device_wait_s: float = 0.0
    """Overlap scheduling: host time spent waiting for a step's tokens. Near 0, the device waited for the
    host instead (host-bound); near the step time, the host kept ahead of the device."""


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are read by `_resolve`."""

    chunks: list[Chunk]
    extend: list[bool]
    """Per chunk: it computes prompt (or recomputed) tokens, so its prefix goes into the radix cache."""
    sampled: list[Chunk]
    """The chunks that sample, then one empty chunk per fork (`StepPlan.forks`), in sample-row order."""
    forks: list[Request]
    num_tokens: int
    """Tokens the forward computed."""
    kv_tokens: int
    """Tokens attended (each chunk's end position), for the decode roofline."""
    tokens: torch.Tensor | None
    """[S] the sampled token ids on the device (the next step's decode inputs are gathered from it)."""
    host: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    """[2, S] float64 tokens and logprobs, copied to (pinned) host memory behind the step; on CPU the
    (tokens, logprobs) tensors themselves."""
    done: torch.cuda.Event | None
    """Recorded after that copy (CUDA); None when the copy is synchronous."""
    alternatives: tuple[list[int], torch.Tensor] | None = None
    """The sample rows of requests that asked for `top_logprobs`, and [2, rows, count] float64 ids and
    logprobs of their most likely tokens (in host memory on CUDA, copied behind the step)."""
    hidden: torch.Tensor | None = None
    """[S, hidden] the sample rows' final-norm hidden states, in `sampled` order (kept for a draft head)."""
    chained: ChainedDrafts | None = None
    """A verify step's next drafts, proposed by the draft head behind it on the device."""


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
        self._reserve_bytes = max(0, int(reserve_bytes))
        if cfg.speculative not in ("off", "ngram", "draft", "head"):
            raise ValueError(
                f"rollout.speculative must be off, ngram, draft or head, got {cfg.speculative!r}"
            )
        if cfg.page_size < 1:
            raise ValueError(f"rollout.page_size must be >= 1, got {cfg.page_size}")
        if cfg.cuda_graph_piecewise_min_batch < 0:
            raise ValueError(
                "rollout.cuda_graph_piecewise_min_batch must be >= 0 (0 disables piecewise graphs), "
                f"got {cfg.cuda_graph_piecewise_min_batch}"
            )
        for key in ("max_running_requests", "max_batch_tokens"):
            if getattr(cfg, key) < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {getattr(cfg, key)}")
        if cfg.max_running_requests > cfg.max_batch_tokens:
            raise ValueError(
                f"rollout.max_running_requests ({cfg.max_running_requests}) must not exceed rollout.max_batch_tokens "
                f"({cfg.max_batch_tokens}): every running request feeds one token per step"
            )
        if cfg.kv_virtual_memory not in ("auto", "on", "off"):
            raise ValueError(
                f"rollout.kv_virtual_memory must be auto, on or off, got {cfg.kv_virtual_memory!r}"
            )
        if cfg.update_policy not in ("finish", "retract"):
            raise ValueError(f"rollout.update_policy must be finish or retract, got {cfg.update_policy!r}")
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.args = model.args
        self.device, self.dtype = model.device, model.dtype
        model.eval()
        self.backend = resolve_backend(cfg.backend, self.device, self.dtype, self.args.head_dim)
        layout = KVLayout.for_model(self.args, self.dtype, cfg.page_size, cfg.record_routing)
        # Deterministic mode never speculates (its point is reproducibility, and a verify chunk is not batch
        # invariant).
        spec_mode = "off" if cfg.deterministic else cfg.speculative
        draft = load_draft_model(model, cfg, draft_model) if spec_mode == "draft" else None
        budget = self._kv_budget_bytes()
        draft_layout = None
        if draft is not None:
            # The draft pool gets the share of the budget that gives it as many tokens as the engine's pool.
            draft_layout = KVLayout.for_model(draft.args, draft.dtype, 1)
            per_token = layout.bytes_per_token + draft_layout.bytes_per_token
            budget = budget * layout.bytes_per_token // per_token
        self.pool = KVPool(layout, layout.pages_for_bytes(budget), self.device, self._keep_kv_addresses())
        self.max_context = self.args.context_length
        if cfg.max_context is not None:
            if not 1 < cfg.max_context <= self.max_context:
                raise ValueError(
                    f"rollout.max_context must be in [2, {self.max_context}] (the model's context: "
                    f"max_position_embeddings, times YaRN's factor), got {cfg.max_context}"
                )
            self.max_context = cfg.max_context
        self.max_seq_len = min(self.max_context, self.pool.capacity_tokens + 1)
        """Tokens a request's prompt and response may hold together: the context, or fewer where the KV pool
        is smaller (the newest token needs no slot). A request that reaches it ends TRUNCATED, as at the end
        of the context, instead of failing for want of a slot it could never get."""
        if self.max_seq_len < self.max_context:
            log.warning(
                "the KV pool holds %d tokens, fewer than the model's context (%d)%s: a request ends TRUNCATED at "
                "%d tokens; give the pool more memory (rollout.kv_cache_fraction / kv_cache_bytes) for longer ones",
                self.pool.capacity_tokens,
                self.max_context,
                " (a draft model's KV shares the budget)" if draft is not None else "",
                self.max_seq_len,
            )
        table = RequestTable(
            cfg.max_running_requests, min(self.max_context, self.pool.capacity_tokens), self.device
        )
        tree = RadixCache(cfg.page_size, self.device, self.pool.free_slots) if cfg.radix_cache else None
        self.kv = KVManager(self.pool, table, tree)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_tokens=cfg.max_batch_tokens, max_running_requests=cfg.max_running_requests
            ),
            self.kv,
        )
        on_gpu = self.device.type == "cuda"
        self.det_chunk = _DET_CHUNK_GPU if on_gpu else _DET_CHUNK_CPU
        self._groups = self.backend == "torch" and not on_gpu
        """Whether batches carry their requests' shared-prefix groups (`ForwardBatch.prefix_groups`)."""
        check_decode_kernel(cfg.flashinfer_decode)  # on CPU too: a typo fails on every machine
        graph_batch = min(cfg.max_running_requests, 1024) if cfg.cuda_graph and on_gpu else 0
        self.runner = ModelRunner(
            model,
            self.pool,
            table,
            self.backend,
            cfg.deterministic,
            self.det_chunk,
            graph_batch,
            cfg.flashinfer_kernel,
            self._use_fused_kernels(cfg),
            cfg.cuda_graph_piecewise_min_batch,
            cfg.record_routing,
            cfg.flashinfer_decode,
            # Rows per request of a verify step, for its CUDA graphs (drafts padded to spec_draft_tokens).
            1 + cfg.spec_draft_tokens if spec_mode != "off" else 0,
        )
        self.drafter: DraftModel | None = None
        if draft is not None and draft_layout is not None:
            self.drafter = self._build_drafter(draft, draft_layout, graph_batch)
        self.head_drafter: DraftHeadProposer | None = None
        if spec_mode == "head":
            head = load_head(model, cfg, draft_head)
            self.head_drafter = DraftHeadProposer(
                head,
                model,
                self._use_fused_kernels(cfg),
                proposal_graphs(head, model, cfg, self.runner.graphs),
            )
        self._head_rows: dict[int, int] = {}
        """Request id -> the row of `_head_hidden` its last token was sampled from (the last step's requests)."""
        self._head_hidden: torch.Tensor | None = None
        """The last resolved step's sample rows' hidden states (`_Launched.hidden`), for the draft head."""
        self._chained: ChainedDrafts | None = None
        """The last resolved step's chained drafts (`_Launched.chained`), for the next proposal."""
        self.eos_ids = set(self.args.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self._weight_version = 0
        self._next_rid = 0
        self._seed_counter = 0
        self._requests: dict[int, Request] = {}
        self._results: dict[int, Sample] = {}
        self._newly_finished: list[int] | None = None
        """Request ids in the order they finished, while a `generate(on_finish=...)` call collects them."""
        self._prompt_texts: dict[int, str] = {}
        self._released = False
        self._weights_broken: str | None = None
        """Why the last `update_weights` failed part-way: the model holds some new tensors and some old."""
        self._warned_draft_oom = False
        self._alternative_requests = 0
        """Unfinished requests that asked for `top_logprobs`: while there are none, a step looks for none."""
        self._last_step_ran = False
        self._abort_flagged = False
        if cfg.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(
                f"rollout.overlap_schedule must be auto, on or off, got {cfg.overlap_schedule!r}"
            )
        # Deterministic mode keeps the plain loop: its point is reproducibility, not speed.
        self.overlap = not cfg.deterministic and (
            cfg.overlap_schedule == "on" or (cfg.overlap_schedule == "auto" and on_gpu)
        )
        if cfg.speculative != "off" and cfg.spec_draft_tokens < 1:
            raise ValueError(f"rollout.spec_draft_tokens must be >= 1, got {cfg.spec_draft_tokens}")
        self.speculative = spec_mode != "off"
        NgramIndex(cfg.spec_ngram_max, cfg.spec_ngram_min)  # checks the n-gram sizes now, not mid-run
        self.spec_gate = SpecGate(cfg.spec_min_accept_length, cfg.spec_probe_every)
        # Drafts come from the newest tokens, so a step that speculates needs the last step's tokens before it
        # is planned, and the next step its own: only plain steps overlap, and only where the gate makes any.
        self.overlap = self.overlap and not (self.speculative and self.spec_gate.always)
        self._in_flight: _Launched | None = None
        self._maybe_stalled = False
        self._drained: list[Sample] = []
        self._row_params: (
            tuple[list[SamplingParams], list[tuple[SamplingParams, _Settings]], SamplingTensors] | None
        ) = None
        """The last step's rows' params, each distinct one with its (temperature, top_k, top_p, min_p), and
        their tensors: reused while the rows have the same params with the same values (checked by value: a
        caller may change a SamplingParams in place between calls)."""
        self._row_seeds: tuple[list[Request], np.ndarray] | None = None
        """The last step's sampling requests and their mixed seeds (`sampling.mix_seeds`)."""
        self.stats = EngineStats()

    def _use_fused_kernels(self, cfg: RolloutConfig) -> bool:
        if cfg.fused_kernels not in ("auto", "on", "off"):
            raise ValueError(f"rollout.fused_kernels must be auto, on or off, got {cfg.fused_kernels!r}")
        if cfg.fused_kernels == "auto":  # compiling pays off for large low-precision models on a GPU
            return self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        return cfg.fused_kernels == "on"

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

    def _keep_kv_addresses(self) -> bool:
        mode = self.cfg.kv_virtual_memory
        if self.device.type != "cuda" or mode == "off":
            return False
        if mode == "on":
            return True  # without driver support VirtualRegion says what to do
        # auto: only where the pool will be released; otherwise torch's allocator keeps it in its accounting
        return self.cfg.release_kv_during_train and virtual_memory.supported(self.device)

    def _kv_budget_bytes(self) -> int:
        """Bytes for the KV pool(s): a fraction of the free device memory, or kv_cache_bytes on CPU."""
        if self.device.type == "cuda":
            virtual_memory.free_orphans()  # a dead engine's pool, collected during a capture
            torch.cuda.synchronize(self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            free = max(0, free - self._reserve_bytes)
            return int(free * self.cfg.kv_cache_fraction)
        return self.cfg.kv_cache_bytes

    def _build_drafter(self, draft: CausalLM, layout: KVLayout, graph_batch: int) -> DraftModel:
        cfg = self.cfg
        pool = KVPool(layout, self.pool.capacity_tokens + 1, self.device, self._keep_kv_addresses())
        width = min(self.max_context, draft.args.context_length, pool.capacity_tokens)
        table = RequestTable(cfg.max_running_requests, width, self.device)
        backend = resolve_backend(cfg.backend, self.device, self.dtype, draft.args.head_dim)
        limit = self._verify_batch_limit()
        if limit:  # with verify graphs a step drafts for at most that many requests
            graph_batch = min(graph_batch, limit)
        runner = ModelRunner(
            draft,
            pool,
            table,
            backend,
            False,
            self.det_chunk,
            graph_batch,
            cfg.flashinfer_kernel,
            self._use_fused_kernels(cfg),
            cfg.cuda_graph_piecewise_min_batch,
            False,
            cfg.flashinfer_decode,
        )
        return DraftModel(runner, cfg.max_batch_tokens, self.args.vocab_size)

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
            ids = self._prompt_ids(prompt)  # a new list, shared by the prompt's samples (never modified)
            error = self.validate_prompt(ids)
            group_id = source.group_id if source is not None else position
            text = prompt if isinstance(prompt, str) else None
            for index in range(params.n):
                rids.append(self._enqueue(ids, error, params, group_id, index, source, text))
        return rids

    def _run_until_finished(self, rids: list[int], between_steps: Callable[[], None] | None = None) -> None:
        stalled = 0
        while any(rid not in self._results for rid in rids):
            if between_steps is not None:
                between_steps()
            progressed = bool(self.step()) or self._last_step_ran
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
    ) -> int:
        """Add a request for `prompt` (its own list of ints, or one its group's samples share: no request
        modifies its prompt), finished at once with `error` (`validate_prompt`'s) if there is one."""
        rid = self._next_rid
        self._next_rid += 1
        if params.seed is not None:
            # The prompt's content too: with one seed for a whole batch (the RL loop's), different prompts
            # must not share random numbers, and the same prompt must draw the same wherever it sits.
            seed = derive_seed(params.seed, prompt_key(prompt), index)
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
            self._abort_flagged = True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

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
        if req is None or req.finished:
            return None
        ids = req.output_ids
        end = len(ids)
        while end and ids[end - 1] < 0:  # placeholders of tokens in flight (overlap scheduling)
            end -= 1
        return ids[:end]

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
        t0 = time.perf_counter()
        finished, self._drained = self._drained, []
        self._last_step_ran = False
        if self._abort_flagged:
            finished.extend(self._resolve())  # an aborted result must not keep a placeholder token
            self._abort_flagged = False
            for req in [r for r in [*self.scheduler.waiting, *self.scheduler.running] if r.abort_requested]:
                finished.append(self._finish(req, SampleStatus.ABORTED, "aborted by the caller"))
        if self._maybe_stalled:  # the last plan left a running request out: its limit may have been lowered
            finished.extend(self._finish_stalled())
        drafts = False
        if self.speculative:
            if self.drafter is not None:  # every step, drafting or not: retracted requests' draft KV goes
                self.drafter.retain({req.rid for req in self.scheduler.running})
            if self.spec_gate.speculate():
                if self._in_flight is not None:  # a plain step let through by the gate, overlapped
                    finished.extend(self._resolve())
                drafting = time.perf_counter()
                self._propose_drafts()
                self.stats.spec_draft_s += time.perf_counter() - drafting
                drafts = any(req.draft for req in self.scheduler.running)
            else:
                for req in self.scheduler.running:
                    req.draft = []
                self.stats.spec_gated_steps += 1
            verified, accepted = self.stats.spec_steps, self.stats.spec_accepted_tokens
        plan = self.scheduler.schedule(in_flight=self._in_flight is not None)
        self._maybe_stalled = plan.stalled_waiting or len(plan.chunks) < len(self.scheduler.running)
        self.stats.preemptions += len(plan.retracted)
        if plan.failed:
            finished.extend(self._resolve())
            for req, message in plan.failed:
                if not req.finished:
                    finished.append(self._finish(req, SampleStatus.ABORTED, message))
        launched = self._launch(plan.chunks, plan.forks, plan.plain_decode) if plan.chunks else None
        if launched is None and self._in_flight is None:
            finished.extend(self._finish_stalled())
        if self._in_flight is not None:
            self._last_step_ran = True
        finished.extend(self._resolve())
        if launched is not None:
            self._commit(launched)
            self._in_flight = launched
            if not self.overlap or drafts:  # the next step's inputs depend on how many drafts are kept
                finished.extend(self._resolve())
            self._last_step_ran = True
            elapsed = time.perf_counter() - t0
            self.stats.steps += 1
            if plan.is_decode:
                if self.speculative:
                    s = self.stats
                    self.spec_gate.record(s.spec_steps - verified, s.spec_accepted_tokens - accepted)
                self.stats.decode_steps += 1
                self.stats.decode_s += elapsed
                self.stats.decode_step_tokens += launched.num_tokens
                self.stats.decode_kv_tokens += launched.kv_tokens
            else:
                self.stats.prefill_s += elapsed
        if not self.scheduler.has_work and self._in_flight is None:
            self._row_seeds = None  # do not keep finished requests alive
        return finished

    def _verify_batch_limit(self) -> int:
        """Largest batch whose verify steps replay a CUDA graph (cuda_graph.py); 0 where verify steps run
        eagerly at any size (CPU, no graphs, flashinfer's fa3 kernels or a flashinfer older than the verify
        graphs were tested with)."""
        graphs = self.runner.graphs
        return graphs.verify_max_batch if graphs is not None else 0

    def _propose_drafts(self) -> None:
        cfg = self.cfg
        graph_limit = self._verify_batch_limit()
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
                or (self._alternative_requests and any(r.params.top_logprobs for r in running))
            ):
                return
            room = self.kv.table.max_context  # positions a request's KV may take: the context's or the pool's
            if not all(
                r.is_decoding and r.output_ids and min(r.remaining_tokens - 1, room - r.seq_len) >= k
                for r in running
            ):
                return
        running = self.scheduler.running
        wanted: list[tuple[Request, int]] = []
        for req in running:
            req.draft = []
            # Not before the first output token: the chunk that ends the prompt is a prefill (it goes into
            # the radix cache, which must never hold draft positions).
            # A request that wants alternatives gets none for draft rows (`_resolve` reads them per plain row).
            if not (req.is_decoding and req.can_grow and req.output_ids) or req.params.top_logprobs:
                continue
            # Bounded so that the kept tokens never pass max_new_tokens or the context, and so that the verify
            # chunk's KV (the sequence and its k drafts) fits the request's table row: min(context, pool).
            k = min(cfg.spec_draft_tokens, req.remaining_tokens - 1, self.kv.table.max_context - req.seq_len)
            if k > 0:
                wanted.append((req, k))
        wanted = self._runnable_drafts(wanted, graph_limit > 0)
        if self.drafter is not None:
            for (req, _), draft in zip(wanted, self._draft_model_proposals(wanted)):
                req.draft = draft
        elif self.head_drafter is not None:
            self._draft_head_proposals(wanted)
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

    def _draft_model_proposals(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """The draft model's drafts for `wanted`; none for anyone when it runs out of device memory: drafts
        are optional, so that costs this step's drafts and the draft's cached keys and values, not the run."""
        assert self.drafter is not None
        try:
            return self.drafter.propose([req for req, _ in wanted], [k for _, k in wanted])
        except torch.cuda.OutOfMemoryError as err:
            if not self._warned_draft_oom:
                log.warning(
                    "the draft model ran out of device memory (%s); this step decodes without drafts. "
                    "Lower rollout.kv_cache_fraction if it recurs",
                    str(err).split(". ")[0],
                )
                self._warned_draft_oom = True
            self.drafter.retain(set())
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return [[] for _ in wanted]

    def _draft_head_proposals(self, wanted: list[tuple[Request, int]]) -> None:
        """The draft head's drafts, for the requests of `wanted` that were in the last step (the others have
        no hidden state to start from); none when it runs out of device memory."""
        assert self.head_drafter is not None
        chained, self._chained = self._chained, None
        if chained is not None:  # drafts proposed behind the last (verify) step, where they follow on
            proposed, rest = chained.read(), []
            for req, k in wanted:
                length, draft = proposed.get(req.rid, (-1, []))
                if length == len(req.output_ids) and len(draft) >= k:
                    req.draft = draft[:k]
                else:
                    rest.append((req, k))
            self.stats.spec_chained_drafts += len(wanted) - len(rest)
            wanted = rest
        rows, hidden = self._head_rows, self._head_hidden
        picked = [(req, k) for req, k in wanted if req.rid in rows]
        if not picked or hidden is None:
            return
        try:
            drafts = self.head_drafter.propose(
                [req for req, _ in picked],
                [k for _, k in picked],
                hidden,
                [rows[req.rid] for req, _ in picked],
            )
        except torch.cuda.OutOfMemoryError as err:
            if not self._warned_draft_oom:
                log.warning(
                    "the draft head ran out of device memory (%s); this step decodes without drafts",
                    str(err).split(". ")[0],
                )
                self._warned_draft_oom = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        for (req, _), draft in zip(picked, drafts):
            req.draft = draft

    def _runnable_drafts(self, wanted: list[tuple[Request, int]], uniform: bool) -> list[tuple[Request, int]]:
        """The drafts the next step can verify. The scheduler drops every draft of a step whose decode rows
        pass the token budget or the free KV (scheduler.py), which would waste a draft model's work: so the
        last requests' drafts are left out until the rest fit, or all of them where verify steps must be
        uniform (`uniform`, verify graphs). While requests wait to be admitted (or prefilled), drafts take
        at most half of the budget decoding leaves, so that admission goes on."""
        running = self.scheduler.running
        decoding = sum(1 for r in running if r.is_decoding)
        rows = decoding + sum(k for _, k in wanted)
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
            rows -= kept.pop()[1]
        return kept

    def _drain(self) -> None:
        """Read the step still in flight; samples it finishes are returned by the next `step()` too."""
        self._drained.extend(self._resolve())

    # weights and memory ----------------------------------------------------------------------------
    def update_weights(self, weights: WeightsInput, version: int | None = None) -> None:
        """Load new weights (model names or HF names; a dict, (name, tensor) pairs, or buckets of either).

        Requests in flight are finished on the old weights first (update_policy=finish) or restarted from
        their prompt on the new ones (retract). The radix cache is flushed: its KV came from the old weights.
        While the KV memory is released (colocated training) nothing can run, so queued requests restart.
        """
        self._drain()
        if self.scheduler.has_work:
            if self.cfg.update_policy == "finish" and not self._released:
                while self.scheduler.has_work:
                    self.step()
            else:
                self.scheduler.retract_all()
                for req in self.scheduler.waiting:
                    self.stats.output_tokens -= len(req.output_ids)  # regenerated on the new weights
                    req.output_ids, req.logprobs, req.stop_text, req.ngram = [], [], None, None
                    req.alternatives = {}
                    req.spec_steps = req.spec_draft_tokens = req.spec_proposed_tokens = 0
                    req.spec_accepted_tokens = 0
        self.flush_cache()
        try:
            load_weights(self.model, weights)
        except BaseException as err:
            # The tensors before the bad one are in already: nothing may be generated from these weights.
            self._weights_broken = f"{type(err).__name__}: {err}"
            raise
        self._weights_broken = None
        self._head_rows, self._head_hidden, self._chained = {}, None, None  # from the old weights
        self.spec_gate.reset()
        self._weight_version = self._weight_version + 1 if version is None else int(version)

    @property
    def draft_model(self) -> CausalLM | None:
        """The model proposing drafts (`rollout.speculative=draft`), else None."""
        return self.drafter.model if self.drafter is not None else None

    @property
    def draft_head(self) -> DraftHead | None:
        """The head proposing drafts (`rollout.speculative=head`), else None."""
        return self.head_drafter.head if self.head_drafter is not None else None

    def draft_weights_changed(self) -> None:
        """Drop the draft model's cached keys and values after its weights changed (trained in place): every
        request's sequence is fed to it again at its next proposal. The speculation gate measures the new
        draft's acceptance at the next decode step."""
        self._drain()
        if self.drafter is not None:
            self.drafter.retain(set())
        self.spec_gate.reset()

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
        if self.drafter is not None:
            self.drafter.release()
        # Retracted: each starts again from its prefill.
        self._head_rows, self._head_hidden, self._chained = {}, None, None
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if not self._released:
            return
        if self.device.type == "cuda":  # the trainer's freed blocks, cached in pieces, make room for the pool
            torch.cuda.empty_cache()
        self.pool.allocate()
        if self.drafter is not None:
            self.drafter.resume()
        self._released = False

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """rollout/* metrics over the window since the last reset."""
        s = self.stats
        busy = s.prefill_s + s.decode_s
        used = self.kv.used_tokens() if not self._released else 0
        capacity = self.pool.capacity_tokens
        out = {
            "rollout/tokens_per_s": s.output_tokens / busy if busy else 0.0,
            "rollout/prefix_hit_rate": s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "rollout/cache_usage": used / capacity,
            "rollout/cache_usage_peak": s.peak_used_tokens / capacity,
            "rollout/preemptions": float(s.preemptions),
            "rollout/output_tokens": float(s.output_tokens),
            "rollout/prefill_tokens": float(s.prefill_tokens),
            "rollout/prompt_tokens": float(s.prompt_tokens),
            "rollout/cached_prompt_tokens": float(s.cached_prompt_tokens),
            "rollout/prefill_s": s.prefill_s,
            "rollout/decode_s": s.decode_s,
            "rollout/aborted": float(s.aborted),
            "rollout/truncated": float(s.truncated),
            "rollout/dropped_rows": float(s.dropped_rows),
            "rollout/spec_accept_length": (
                1.0 + s.spec_accepted_tokens / s.spec_steps if s.spec_steps else 0.0
            ),
            "rollout/spec_steps": float(s.spec_steps),
            "rollout/spec_draft_tokens": float(s.spec_draft_tokens),
            "rollout/spec_proposed_tokens": float(s.spec_proposed_tokens),
            "rollout/spec_accepted_tokens": float(s.spec_accepted_tokens),
            "rollout/spec_draft_s": s.spec_draft_s,
            "rollout/spec_chained_drafts": float(s.spec_chained_drafts),
            "rollout/spec_gated_steps": float(s.spec_gated_steps),
            "rollout/weight_version": float(self._weight_version),
            "rollout/device_wait_s": s.device_wait_s,
        }
        if reset:
            self.stats = EngineStats(peak_used_tokens=used)
        return out

    # internals -----------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError("the engine's KV memory is released; call engine.resume_memory() first")
        if self._weights_broken is not None:
            raise RuntimeError(
                f"the last update_weights failed part-way ({self._weights_broken}), leaving the model with some "
                "new and some old weights; call update_weights again with a whole set before generating"
            )

    def _prompt_ids(self, prompt: Sample | list[int] | str) -> list[int]:
        """A new list of Python ints (ids may come as numpy or torch scalars)."""
        if isinstance(prompt, Sample):
            if prompt.prompt_ids:
                return [int(t) for t in prompt.prompt_ids]
            prompt = prompt.prompt  # type: ignore[assignment]
            if isinstance(prompt, list):
                if self.tokenizer is None:
                    raise ValueError("chat-message prompts need a tokenizer (or fill Sample.prompt_ids)")
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding here, 4.x a list
                    ids = ids["input_ids"]
                return [int(t) for t in ids]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or give Engine a tokenizer")
            return [int(t) for t in self.tokenizer(prompt, add_special_tokens=False)["input_ids"]]
        return [int(t) for t in prompt]

    def validate_prompt(self, ids: list[int]) -> str | None:
        if not ids:
            return "empty prompt: a request needs at least one prompt token"
        vocab = self.args.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})"
        if len(ids) + 1 > self.max_context:
            return (
                f"prompt has {len(ids)} tokens but the context is {self.max_context} tokens "
                "(max_position_embeddings, YaRN's factor, rollout.max_context), so no token can be generated; "
                "drop or truncate long prompts (data.max_prompt_length)"
            )
        if len(ids) > self.pool.capacity_tokens:
            return (
                f"prompt has {len(ids)} tokens but the KV pool holds only {self.pool.capacity_tokens}; raise "
                "rollout.kv_cache_bytes (CPU) / rollout.kv_cache_fraction (GPU) or drop long prompts"
            )
        return None

    def _launch(
        self, chunks: list[Chunk], forks: list[tuple[Request, Request]], plain_decode: bool = False
    ) -> _Launched:
        """Queue the forward and sampling of `chunks` (and of the `forks`, which sample their leaders' last
        logits rows); nothing here waits for the device. `plain_decode`: every chunk is a running request's
        next token (`StepPlan.plain_decode`), which skips the per-chunk accounting of prompt tokens."""
        s = self.stats
        if plain_decode:  # admitted when their prompts ran; nothing goes into the radix cache
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
        hidden = self.runner.last_hidden if self.head_drafter is not None else None
        if routing is not None and self.pool.routing is not None:
            self.pool.routing[batch.out_slots] = (
                routing[:, : batch.num_tokens].permute(1, 0, 2).to(torch.int16)
            )
        for c in chunks:
            c.req.inflight_tokens = c.length
        sampled = chunks if plain_decode else [c for c in chunks if c.samples]
        fork_reqs = [req for req, _ in forks]
        counts = (batch.num_tokens, sum(batch.kv_lens))
        if not sampled:
            return _Launched(chunks, extend, sampled, fork_reqs, *counts, None, None, None, hidden=hidden)
        if plain_decode:
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
        tokens, logprobs, st = self._sample(logits, reqs, offsets)
        alternatives = self._alternatives(logits, reqs)
        if self.device.type != "cuda":  # read by `tolist` at once: no [2, S] float64 copy to make
            host = (tokens, logprobs)
            chained = self._chain(batch, sampled, forks, hidden, tokens, st)
            return _Launched(
                chunks, extend, sampled, fork_reqs, *counts, tokens, host, None, alternatives, hidden, chained
            )
        values = torch.stack([tokens.double(), logprobs.double()])
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        if alternatives is not None:
            pinned = torch.empty(alternatives[1].shape, dtype=torch.float64, pin_memory=True)
            pinned.copy_(alternatives[1], non_blocking=True)
            alternatives = (alternatives[0], pinned)
        done = torch.cuda.Event()
        done.record()
        chained = self._chain(batch, sampled, forks, hidden, tokens, st)  # behind the tokens' copy
        return _Launched(
            chunks, extend, sampled, fork_reqs, *counts, tokens, host, done, alternatives, hidden, chained
        )

    def _chain(
        self,
        batch: ForwardBatch,
        sampled: list[Chunk],
        forks: list[tuple[Request, Request]],
        hidden: torch.Tensor | None,
        tokens: torch.Tensor,
        st: SamplingTensors,
    ) -> ChainedDrafts | None:
        """The draft head's next proposal, chained behind a verify step whose requests all verified drafts
        of one length (draft_head.py); None for other steps."""
        if self.head_drafter is None or hidden is None or not batch.verify_len or forks:
            return None
        reqs = [c.req for c in sampled]
        return self.head_drafter.chain(hidden, tokens, batch.input_ids, reqs, st, self.cfg.spec_draft_tokens)

    def _alternatives(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[list[int], torch.Tensor] | None:
        """The most likely tokens of the sample rows whose requests asked for `top_logprobs` (rare outside
        serving: nothing is computed for a step without them)."""
        if not self._alternative_requests:
            return None
        rows = [i for i, req in enumerate(reqs) if req.params.top_logprobs]
        if not rows:
            return None
        params = [reqs[i].params for i in rows]
        st = SamplingTensors.build(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            np.zeros(len(rows)),
            self.args.vocab_size,
            self.device,
        )
        picked = logits if len(rows) == len(reqs) else logits[host_to_device(np.asarray(rows), self.device)]
        ids, values = top_alternatives(picked, st, max(p.top_logprobs for p in params))
        return rows, torch.stack([ids.double(), values.double()])

    def _count_admission(self, req: Request, cached: int) -> None:
        """A request's first chunk (or attached fork), starting at position `cached`: the prompt and
        cache-hit counters."""
        s = self.stats
        req.admitted = True
        req.cached_tokens = cached
        s.requests += 1
        s.prompt_tokens += len(req.prompt_ids)
        s.cached_prompt_tokens += min(cached, len(req.prompt_ids))

    def _commit(self, step: _Launched) -> None:
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
        """Requests whose output already reached `max_new_tokens`, lowered in place on their params while
        they ran: nothing is scheduled for them and no token of theirs is in flight, so they end here instead
        of waiting for ever (`_finish` cuts them to the new limit)."""
        stalled = [
            r
            for r in [*self.scheduler.running, *self.scheduler.waiting]
            if not r.can_grow and r.pending_index < 0
        ]
        return [self._finish(req, SampleStatus.TRUNCATED) for req in stalled]

    def _resolve(self) -> list[Sample]:
        """Wait for the step in flight, put its tokens in place of the placeholders, finish requests."""
        step, self._in_flight = self._in_flight, None
        if step is None or step.host is None:
            return []
        if step.done is not None:
            waited = time.perf_counter()
            step.done.synchronize()  # the step's tokens only, not whatever was queued after it
            self.stats.device_wait_s += time.perf_counter() - waited
        tokens, logprobs = (values.tolist() for values in step.host)
        alternatives: dict[int, tuple[list[float], list[float]]] = {}
        if step.alternatives is not None:
            alt_rows, alt = step.alternatives
            alternatives = dict(zip(alt_rows, zip(*alt.tolist())))
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
                status = self._accept(req, c.draft, tokens[first:row], logprobs[first:row], cuts)
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
        if head_rows is not None:
            self._head_rows, self._head_hidden, self._chained = head_rows, step.hidden, step.chained
        self.stats.output_tokens += plain
        self.kv.truncate(cuts)
        return finished

    def _accept(
        self,
        req: Request,
        draft: tuple[int, ...],
        tokens: list[float],
        logprobs: list[float],
        cuts: list[tuple[Request, int]],
    ) -> SampleStatus | None:
        """Keep the sampled tokens of a verify chunk up to the first that differs from its draft token.

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
        s = self.stats
        s.output_tokens += kept
        s.spec_steps += 1
        s.spec_draft_tokens += len(draft)
        s.spec_proposed_tokens += req.draft_proposed
        s.spec_accepted_tokens += accepted
        return status

    def _build_batch(self, chunks: list[Chunk], plain_decode: bool = False) -> ForwardBatch:
        dev = self.device
        count = len(chunks)
        reqs = [c.req for c in chunks]
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=count)
        every_token_samples = plain_decode or all(c.length == 1 and c.samples for c in chunks)
        verify_len = 0
        if every_token_samples:  # decode-shaped: one token each, all sample
            # Each feeds its sequence's last token.
            ids = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
            lens = np.ones(count, dtype=np.int64)
            positions = starts
            sample_index = torch.arange(count, device=dev)
        else:
            ids = []
            rows_with_logits: list[int] = []
            for c in chunks:
                ids.extend(c.req.tokens(c.start, c.start + c.length - len(c.draft)))
                ids.extend(c.draft)
                rows_with_logits.extend(range(len(ids) - c.sample_rows, len(ids)))
            lens = np.fromiter((c.length for c in chunks), dtype=np.int64, count=count)
            positions = concat_ranges(starts, lens)
            sample_index = host_to_device(torch.tensor(rows_with_logits, dtype=torch.long), dev)
            first = chunks[0].length
            if first > 1 and all(
                c.draft and c.samples and c.length == first == c.sample_rows for c in chunks
            ):
                verify_len = first
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=count)
        out_slots = self.kv.alloc_extend(rows, starts, lens)
        # Token ids and positions in one copy to the device (np.array of a list is faster than torch.tensor).
        input_ids, device_positions = host_to_device(
            np.stack([np.array(ids, dtype=np.int64), positions]), dev
        )
        if self._in_flight is not None and self._in_flight.tokens is not None:
            # Tokens still on the device (placeholders -1): gather them from the step in flight.
            where, pending, offset = [], [], 0
            for c in chunks:
                req = c.req
                if req.pending_index >= 0 and c.start <= req.seq_len - 1 < c.start + c.length:
                    where.append(offset + req.seq_len - 1 - c.start)
                    pending.append(req.pending_index)
                offset += c.length
            if where:
                index, source = host_to_device(np.array([where, pending], dtype=np.int64), dev)
                input_ids[index] = self._in_flight.tokens[source]
        return ForwardBatch(
            input_ids=input_ids,
            positions=device_positions,
            out_slots=out_slots,
            rows=rows.tolist(),
            q_lens=lens.tolist(),
            kv_lens=(starts + lens).tolist(),
            sample_index=sample_index,
            # Requests pinned to the same radix node share their first prefix_len slots (read by the CPU
            # attention only, which attends to a shared prefix once per group).
            prefix_groups=[id(r.node) if r.node is not None else -1 for r in reqs] if self._groups else None,
            prefix_lens=[r.prefix_len for r in reqs] if self._groups else None,
            every_token_samples=every_token_samples,
            verify_len=verify_len,
        )

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], offsets: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, SamplingTensors]:
        """Row i samples response position len(output) + offsets[i] of request reqs[i] (offsets None: all 0):
        offsets > 0 are draft rows, whose uniform numbers are the ones plain decoding would use there, so
        speculation changes no sample. Returns the tokens, their logprobs and the rows' settings."""
        if self._row_seeds is None or self._row_seeds[0] != reqs:  # the same requests as last step: kept
            self._row_seeds = (reqs, mix_seeds([r.seed for r in reqs]))
        positions = np.fromiter((len(r.output_ids) for r in reqs), dtype=np.uint64, count=len(reqs))
        if offsets is not None:
            positions += offsets
        uniform = uniforms_of_mixed(self._row_seeds[1], positions)
        params = [r.params for r in reqs]
        kept = self._row_params
        # Reused while the rows have the same params with the same values (typically one shared object).
        if kept is not None and kept[0] == params and all(_settings(p) == v for p, v in kept[1]):
            st = replace(kept[2], uniform=host_to_device(uniform, self.device))
        else:
            temperature, top_k, top_p, min_p = (list(column) for column in zip(*map(_settings, params)))
            st = SamplingTensors.build(
                temperature, top_k, top_p, min_p, uniform, self.args.vocab_size, self.device
            )
            distinct = {id(p): p for p in params}.values()
            self._row_params = (params, [(p, _settings(p)) for p in distinct], st)
        with fused.fused_kernels(self.runner.fused_kernels):
            return (*self._sample_rows(logits, st), st)

    def _sample_rows(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        num = logits.shape[0]
        if self.cfg.deterministic:  # fixed row blocks, padded, as for the forward
            block = self.det_chunk
            padded = F.pad(logits, (0, 0, 0, (-num) % block))
            st_pad = SamplingTensors(
                *(
                    F.pad(t, (0, (-num) % block))
                    for t in (st.temperature, st.top_k, st.top_p, st.min_p, st.uniform)
                ),
                st.any_greedy,
                st.all_greedy,
                st.any_filter,
            )
            out = [
                sample(padded[i : i + block], st_pad.rows(slice(i, i + block)))
                for i in range(0, padded.shape[0], block)
            ]
        else:
            tokens, logprobs, _ = sample_rows(logits, st, self.runner.graphs)
            return tokens, logprobs
        return torch.cat([t for t, _ in out])[:num], torch.cat([lp for _, lp in out])[:num]

    def _finish(self, req: Request, status: SampleStatus, error: str | None = None) -> Sample:
        if req.params.top_logprobs and not req.finished:
            self._alternative_requests -= 1
        # Finished while its next step is queued (overlap): that step's KV slots are the request's too.
        req.kv_len += req.inflight_tokens
        req.inflight_tokens = 0
        routed = self._routing_of(req) if req.params.return_routing else None
        if routed is None and req.params.return_routing and req.output_ids and status != SampleStatus.ABORTED:
            # Without it the trainer's routing replay could not use the sample: it costs the sample, not the run.
            status = SampleStatus.ABORTED
            error = "its recorded MoE routing was lost (retracted while its KV left the cache)"
        self.kv.release(req)  # all it computed: those keys and values are right, whatever is returned
        if self.drafter is not None:
            self.drafter.forget(req.rid)
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
                del routed[len(req.prompt_ids) + max(limit, 1) - 1 :]
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

    def _routing_of(self, req: Request) -> list[list[list[int]]] | None:
        """Experts chosen at every position fed to the model (the prompt, then the response minus its last
        token), read from the slot store; the layout `Sample.routed_experts` documents for routing replay."""
        if self.pool.routing is None or not req.output_ids:
            return None
        if req.row >= 0:
            fed = len(req.prompt_ids) + len(req.output_ids) - 1
            slots = self.kv.table.table[req.row, :fed].long()
        else:
            # Retracted (preemption, `release_memory`) and ended while waiting (its max_new_tokens lowered
            # to its output): what it computed went into the radix cache, where it may still be.
            fed = len(req.prompt_ids) + min(len(req.output_ids), max(req.params.max_new_tokens, 1)) - 1
            match = self.kv.tree.match_prefix(req.tokens(0, fed)) if self.kv.tree is not None else None
            if match is None or match.length < fed:
                return None
            slots = match.slots[:fed].long()
        return self.pool.routing[slots].tolist()
