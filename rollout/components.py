"""`EngineParts`: what an `Engine` runs on, built from the model and the rollout config: the KV pool and its
manager (with the radix cache), the scheduler, the model runner, the row sampler and, with
`rollout.speculative`, the speculative decoder with its draft model or head."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from miles.config import RolloutConfig
from miles.models.draft_head import DraftHead
from miles.models.model import CausalLM
from miles.rollout.kv.budget import keeps_kv_addresses, kv_budget_bytes
from miles.rollout.kv.manager import KVManager
from miles.rollout.kv.pool import KVLayout, KVPool, RequestTable
from miles.rollout.kv.radix_cache import RadixCache
from miles.rollout.model_runner import ModelRunner, resolve_backend, use_fused_kernels
from miles.rollout.sampling.rows import RowSampler
from miles.rollout.scheduler import Scheduler, SchedulerConfig
from miles.rollout.spec.decoder import SpecDecoder
from miles.rollout.spec.draft_model import DraftModel, load_draft_model
from miles.rollout.spec.head import DraftHeadProposer, load_head, proposal_graphs

log = logging.getLogger(__name__)

DET_CHUNK_CPU, DET_CHUNK_GPU = 16, 256
"""Fixed token-chunk size of deterministic mode (every matmul sees this many rows)."""


@dataclass
class EngineParts:
    backend: str
    """The attention backend (`rollout.backend` resolved for the device): torch | flashinfer."""
    pool: KVPool
    kv: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: RowSampler
    spec: SpecDecoder | None
    """The speculative decoder; None without speculation (off, or deterministic mode)."""
    max_context: int
    """The longest prompt + response: the model's context, or `rollout.max_context`."""
    max_seq_len: int
    """Tokens a request's prompt and response may hold together: the context, or fewer where the KV pool
    is smaller (the newest token needs no slot). A request that reaches it ends TRUNCATED, as at the end
    of the context, instead of failing for want of a slot it could never get."""
    eos_ids: set[int]
    prefix_groups: bool
    """Whether batches carry their requests' shared-prefix groups (`ForwardBatch.prefix_groups`)."""
    overlap: bool
    """Overlap scheduling (`rollout.overlap_schedule`) where it applies."""


@dataclass
class _Context:
    """What the parts are built for: the model, its config and its memory."""

    model: CausalLM
    cfg: RolloutConfig
    fused_kernels: bool
    det_chunk: int
    graph_batch: int
    """Largest decode batch captured in CUDA graphs (0: none)."""


def build_engine_parts(
    model: CausalLM,
    tokenizer: Any | None,
    cfg: RolloutConfig,
    reserve_bytes: int = 0,
    draft_model: CausalLM | None = None,
    draft_head: DraftHead | None = None,
) -> EngineParts:
    """The parts of an engine on `model` (the `Engine` arguments of the same names)."""
    args, device, dtype = model.args, model.device, model.dtype
    backend = resolve_backend(cfg.backend, device, dtype, args.head_dim)
    layout = KVLayout.for_model(args, dtype, cfg.page_size, cfg.record_routing)
    # Deterministic mode never speculates (its point is reproducibility, and a verify chunk is not batch
    # invariant).
    spec_mode = "off" if cfg.deterministic else cfg.speculative
    draft = load_draft_model(model, cfg, draft_model) if spec_mode == "draft" else None
    budget = kv_budget_bytes(cfg, device, max(0, int(reserve_bytes)))
    draft_layout = None
    if draft is not None:
        # The draft pool gets the share of the budget that gives it as many tokens as the engine's pool.
        draft_layout = KVLayout.for_model(draft.args, draft.dtype, 1)
        per_token = layout.bytes_per_token + draft_layout.bytes_per_token
        budget = budget * layout.bytes_per_token // per_token
    pool = KVPool(layout, layout.pages_for_bytes(budget), device, keeps_kv_addresses(cfg, device))
    max_context = cfg.max_context if cfg.max_context is not None else args.context_length
    max_seq_len = min(max_context, pool.capacity_tokens + 1)
    if max_seq_len < max_context:
        log.warning(
            "the KV pool holds %d tokens, fewer than the model's context (%d)%s: a request ends TRUNCATED at "
            "%d tokens; give the pool more memory (rollout.kv_cache_fraction / kv_cache_bytes) for longer ones",
            pool.capacity_tokens,
            max_context,
            " (a draft model's KV shares the budget)" if draft is not None else "",
            max_seq_len,
        )
    table = RequestTable(cfg.max_running_requests, min(max_context, pool.capacity_tokens), device)
    tree = RadixCache(cfg.page_size, device, pool.free_slots) if cfg.radix_cache else None
    kv = KVManager(pool, table, tree)
    scheduler = Scheduler(
        SchedulerConfig(max_batch_tokens=cfg.max_batch_tokens, max_running_requests=cfg.max_running_requests),
        kv,
    )
    on_gpu = device.type == "cuda"
    context = _Context(
        model,
        cfg,
        use_fused_kernels(cfg.fused_kernels, device, dtype),
        DET_CHUNK_GPU if on_gpu else DET_CHUNK_CPU,
        min(cfg.max_running_requests, 1024) if cfg.cuda_graph and on_gpu else 0,
    )
    runner = ModelRunner(
        model,
        pool,
        table,
        backend,
        cfg.deterministic,
        context.det_chunk,
        context.graph_batch,
        cfg.flashinfer_kernel,
        context.fused_kernels,
        cfg.cuda_graph_piecewise_min_batch,
        cfg.record_routing,
        cfg.flashinfer_decode,
        # Rows per request of a verify step, for its CUDA graphs (drafts padded to spec_draft_tokens).
        1 + cfg.spec_draft_tokens if spec_mode != "off" else 0,
    )
    eos_ids = set(args.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    spec = None
    if spec_mode != "off":
        graphs = runner.graphs
        verify_limit = graphs.verify_max_batch if graphs is not None else 0
        drafter = head_drafter = None
        if draft is not None and draft_layout is not None:
            drafter = _draft_model(context, draft, draft_layout, pool, max_context, verify_limit)
        if spec_mode == "head":
            head = load_head(model, cfg, draft_head)
            graphed = proposal_graphs(head, model, cfg, graphs)
            head_drafter = DraftHeadProposer(head, model, context.fused_kernels, graphed)
        spec = SpecDecoder(
            cfg, scheduler, kv, verify_limit, eos_ids, max_seq_len, tokenizer, drafter, head_drafter
        )
    # Deterministic mode keeps the plain loop: its point is reproducibility, not speed. Drafts come from the
    # newest tokens, so a step that speculates needs the last step's tokens before it is planned, and the next
    # step its own: only plain steps overlap, and only where the gate makes any.
    overlap = (
        not cfg.deterministic
        and (cfg.overlap_schedule == "on" or (cfg.overlap_schedule == "auto" and on_gpu))
        and not (spec is not None and spec.gate.always)
    )
    return EngineParts(
        backend=backend,
        pool=pool,
        kv=kv,
        scheduler=scheduler,
        runner=runner,
        sampler=RowSampler(runner, args.vocab_size, cfg.deterministic, context.det_chunk),
        spec=spec,
        max_context=max_context,
        max_seq_len=max_seq_len,
        eos_ids=eos_ids,
        prefix_groups=backend == "torch" and not on_gpu,
        overlap=overlap,
    )


def _draft_model(
    context: _Context, draft: CausalLM, layout: KVLayout, pool: KVPool, max_context: int, verify_limit: int
) -> DraftModel:
    """The draft model with a KV pool of its own, as many tokens as the engine's `pool`, and a runner like
    the engine's (never deterministic: deterministic mode does not speculate). With verify graphs a step
    drafts for at most `verify_limit` requests."""
    cfg, device = context.cfg, context.model.device
    draft_pool = KVPool(layout, pool.capacity_tokens + 1, device, keeps_kv_addresses(cfg, device))
    width = min(max_context, draft.args.context_length, draft_pool.capacity_tokens)
    table = RequestTable(cfg.max_running_requests, width, device)
    backend = resolve_backend(cfg.backend, device, context.model.dtype, draft.args.head_dim)
    graph_batch = min(context.graph_batch, verify_limit) if verify_limit else context.graph_batch
    runner = ModelRunner(
        draft,
        draft_pool,
        table,
        backend,
        False,
        context.det_chunk,
        graph_batch,
        cfg.flashinfer_kernel,
        context.fused_kernels,
        cfg.cuda_graph_piecewise_min_batch,
        False,
        cfg.flashinfer_decode,
    )
    return DraftModel(runner, cfg.max_batch_tokens, context.model.args.vocab_size)
