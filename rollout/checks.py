"""`check_rollout_config`: every rollout setting the engine would refuse, checked from the config alone, so
the start-time validation can run it before any model loads (the Engine runs it too)."""

from __future__ import annotations

from miles.config import RolloutConfig
from miles.rollout.attention.flashinfer_backend import check_decode_kernel
from miles.rollout.spec.gate import SpecGate
from miles.rollout.spec.ngram import NgramIndex

_MODES = ("auto", "on", "off")


def check_rollout_config(cfg: RolloutConfig, context_length: int | None = None) -> None:
    """Raise ValueError for a setting the engine cannot run. `context_length`: the model's context
    (max_position_embeddings, times YaRN's factor), which bounds `rollout.max_context`; None: not checked."""
    if cfg.speculative not in ("off", "ngram", "draft", "head"):
        raise ValueError(f"rollout.speculative must be off, ngram, draft or head, got {cfg.speculative!r}")
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
    for key in ("kv_virtual_memory", "overlap_schedule", "fused_kernels"):
        if getattr(cfg, key) not in _MODES:
            raise ValueError(f"rollout.{key} must be auto, on or off, got {getattr(cfg, key)!r}")
    if cfg.update_policy not in ("finish", "retract"):
        raise ValueError(f"rollout.update_policy must be finish or retract, got {cfg.update_policy!r}")
    if (
        context_length is not None
        and cfg.max_context is not None
        and not 1 < cfg.max_context <= context_length
    ):
        raise ValueError(
            f"rollout.max_context must be in [2, {context_length}] (the model's context: "
            f"max_position_embeddings, times YaRN's factor), got {cfg.max_context}"
        )
    check_decode_kernel(cfg.flashinfer_decode)
    if cfg.speculative != "off" and cfg.spec_draft_tokens < 1:
        raise ValueError(f"rollout.spec_draft_tokens must be >= 1, got {cfg.spec_draft_tokens}")
    NgramIndex(cfg.spec_ngram_max, cfg.spec_ngram_min)  # raises on bad n-gram sizes
    SpecGate(cfg.spec_min_accept_length, cfg.spec_probe_every)  # raises on bad gate settings
