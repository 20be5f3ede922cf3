"""Shared by the rollout tests: tiny random models and transformers' own sampling distribution."""

from __future__ import annotations

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
