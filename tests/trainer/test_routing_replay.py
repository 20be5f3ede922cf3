"""Routing replay end to end: experts recorded by the engine are replayed by the trainer."""

from __future__ import annotations

import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from miles.models import CausalLM, ModelArgs
from miles.rollout import Engine, SamplingParams
from miles.trainer import PolicyTrainer


def test_trainer_replays_the_engines_routing() -> None:
    torch.manual_seed(0)
    args = ModelArgs(
        model_type="qwen3_moe",
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    model = CausalLM(args)
    model.init_weights(std=0.3)  # large weights: near-tied router scores are common
    engine = Engine(model, None, RolloutConfig(record_routing=True))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    samples = engine.generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3, return_routing=True)
    )
    for s in samples:
        assert s.routed_experts.dtype == torch.int16  # compact, [fed token, layer, top_k]
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2)

    trainer = PolicyTrainer(model, TrainerConfig(routing_replay=True), AlgorithmConfig(), temperature=1.0)
    replayed = trainer.logprobs(samples)
    for s, lp in zip(samples, replayed):
        assert torch.allclose(
            torch.as_tensor(lp, dtype=torch.float32), torch.tensor(s.rollout_logprobs), atol=1e-5
        )

    # Replaying other experts than the ones chosen must change the logprobs (the replay is really used).
    for s in samples:
        s.routed_experts = (s.routed_experts + 1) % 6
    shifted = trainer.logprobs(samples)
    diffs = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(shifted, replayed)]
    assert max(diffs) > 1e-3
