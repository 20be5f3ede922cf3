"""Shared by the rollout tests: tiny random models and transformers' own sampling distribution."""

from __future__ import annotations

from typing import Any

import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from miles.config import RolloutConfig
from miles.models import CausalLM, ModelArgs

OVERLAP_MODE = {"value": "off"}
"""The engine step loop `rollout_config` uses; the `overlap_mode` fixture (conftest.py) sets it per test."""


def rollout_config(defaults: dict[str, object], overrides: dict[str, object]) -> RolloutConfig:
    cfg = RolloutConfig(**defaults)  # type: ignore[arg-type]
    cfg.overlap_schedule = OVERLAP_MODE["value"]
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_args(moe: bool = False, **overrides: object) -> ModelArgs:
    base: dict[str, object] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if moe:
        base.update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    base.update(overrides)
    return ModelArgs(**base)  # type: ignore[arg-type]


def tiny_model(moe: bool = False, seed: int = 0, **overrides: object) -> CausalLM:
    model = CausalLM(tiny_args(moe, **overrides))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def gpu_model(
    moe: bool, seed: int = 0, kv_heads: int = 2, moe_intermediate_size: int = 128, **sizes: object
) -> CausalLM:
    """The rollout tests' tiny model at flashinfer-friendly sizes (head_dim 128), in bf16 on the GPU;
    `sizes` overrides the shape (e.g. larger weights)."""
    shape: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=128,
        max_position_embeddings=1024,
    )
    if moe:
        shape["moe_intermediate_size"] = moe_intermediate_size
    return tiny_model(moe, seed, **{**shape, **sizes}).to(device="cuda", dtype=torch.bfloat16)


def count_graph_captures(monkeypatch: Any) -> list[int]:
    """A list that gets one entry per CUDA graph capture from now on (CudaGraphRunner.capture wrapped)."""
    from miles.rollout.cuda_graph import CudaGraphRunner

    captures: list[int] = []
    capture = CudaGraphRunner.capture

    def counted(self: CudaGraphRunner) -> None:
        captures.append(1)
        capture(self)

    monkeypatch.setattr(CudaGraphRunner, "capture", counted)
    return captures


def hf_logq(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """log of the distribution transformers' sampling draws from (warpers in generate's order)."""
    scores = logits.clone()[None]
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.log_softmax(scores[0], dim=-1)


def full_forward_logprobs(
    model: CausalLM,
    prompt: list[int],
    response: list[int],
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]))[0, len(prompt) - 1 : -1]
    rows = [hf_logq(row, temperature, top_k, top_p, min_p)[token] for row, token in zip(logits, response)]
    return torch.stack(rows)


def assert_pool_clean(engine: Any) -> None:
    """Nothing leaked: every slot is free or held (unlocked) by the radix tree; every table row is free."""
    tree = engine.kv.tree
    cached = tree.total_size if tree is not None else 0
    assert engine.pool.free_tokens + cached == engine.pool.capacity_tokens
    assert tree is None or tree.protected_size == 0
    assert engine.kv.table.num_free == engine.kv.table.max_requests
    drafter = getattr(engine, "drafter", None)
    if drafter is not None:  # the draft model's pool: every finished request's sequence dropped
        assert not drafter.seqs
        assert drafter.pool.free_tokens == drafter.pool.capacity_tokens
        assert drafter.table.num_free == drafter.table.max_requests
