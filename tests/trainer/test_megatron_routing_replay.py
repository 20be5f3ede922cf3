"""Routing replay (R3) on the megatron backend: megatron's routers take the experts the engine recorded.

The engine records each fed token's experts; replayed, every one of them is the expert megatron's router
uses (100 %), and the trainer's logprobs are the engine's. Routes other than the routers' own (what a
rollout on other weights or kernels records) give the rollout's logprobs only with replay on: the
`mismatch/*` metrics fall from > 1e-3 to float rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from miles.models import RoutingTrace, VarlenAttention
from miles.rollout import Engine, SamplingParams
from miles.trainer import PolicyTrainer
from miles.trainer.packing import pack
from tests.support.trainer import tiny_model

pytest.importorskip("megatron.core")


def test_megatron_routers_replay_the_engines_experts() -> None:
    from miles.trainer.megatron.policy import MegatronPolicy

    model = tiny_model(std=0.3, vocab_size=40, num_experts=6)  # large weights: near-tied router scores
    engine = Engine(model, None, RolloutConfig(record_routing=True))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3, return_routing=True)
    samples = engine.generate([[1, 2, 3, 4, 5], [7, 8, 9]], params)
    policy = MegatronPolicy.from_model(copy.deepcopy(model))

    batch = pack(samples, list(range(len(samples))), 10_000, torch.device("cpu"), routing_replay=True)[0]
    trace = RoutingTrace(record=True, replay=batch.routing_replay)
    with torch.no_grad():
        out = policy.forward_packed(
            batch.input_ids, batch.positions, VarlenAttention(batch.cu_seqlens), trace
        )
    engine_routes = batch.routing_replay.sort(dim=-1).values  # megatron records ids in ascending order
    assert torch.equal(out.routing, engine_routes) and torch.equal(trace.stacked(), engine_routes)  # 100 %

    replaying = PolicyTrainer(policy, TrainerConfig(routing_replay=True), AlgorithmConfig(), temperature=1.0)
    for s, lp in zip(samples, replaying.logprobs(samples)):
        torch.testing.assert_close(lp, torch.tensor(s.rollout_logprobs), atol=1e-5, rtol=0)

    # Routes that are not the routers' choice, with the rollout logprobs the torch backend replays them to.
    for s in samples:
        s.routed_experts = (s.routed_experts + 1) % 6
    theirs = PolicyTrainer(model, TrainerConfig(routing_replay=True), AlgorithmConfig(), temperature=1.0)
    for s, lp in zip(samples, theirs.logprobs(samples)):
        s.rollout_logprobs = lp.tolist()
    metrics = {}
    for replay in (True, False):
        cfg = TrainerConfig(routing_replay=replay, lr=0.0, global_batch_size=len(samples))
        policy = MegatronPolicy.from_model(copy.deepcopy(model))
        metrics[replay] = PolicyTrainer(policy, cfg, AlgorithmConfig(), temperature=1.0).train_step(samples)
    on, off = metrics[True], metrics[False]
    assert on["mismatch/logprob_abs_diff_max"] < 1e-5 and on["mismatch/kl"] < 1e-9
    assert off["mismatch/logprob_abs_diff_max"] > 1e-3
    for key in ("mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl"):
        assert on[key] < off[key], key
