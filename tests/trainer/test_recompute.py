"""Activation recomputation (trainer/recompute.py) leaves the gradients as they were, on both backends."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.config import AlgorithmConfig, TrainerConfig
from miles.errors import MilesUserError
from miles.models.moe import RoutingTrace
from miles.trainer import PolicyTrainer
from miles.trainer.backends import build_policy
from miles.trainer.logprobs import packed_logprobs
from miles.trainer.packing import pack
from miles.trainer.recompute import apply_recompute
from tests.support.dp import scored_samples
from tests.support.trainer import tiny_model


def _gradients(policy: torch.nn.Module, replay: bool = False) -> dict[str, torch.Tensor]:
    samples = scored_samples(6)
    batch = pack(samples, list(range(len(samples))), 10_000, torch.device("cpu"), replay)[0]
    out = packed_logprobs(policy, batch, with_entropy=True, entropy_grad=True)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("backend", ["torch", "megatron"])
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_recompute_leaves_gradients_unchanged(backend: str, experts: int) -> None:
    policy = build_policy(backend, tiny_model(seed=2, num_experts=experts))
    want = _gradients(policy)
    for mode in ("selective", "full"):
        wrapped = apply_recompute(policy, mode)
        assert wrapped == (2 if mode == "full" else 4)  # two layers; attention + MLP each when selective
        got = _gradients(policy)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=f"{mode} {name}")
    assert apply_recompute(policy, "none") == 0
    assert not any("_miles_recompute_originals" in m.__dict__ for m in policy.modules())


def test_recompute_does_not_record_routing_twice() -> None:
    model = tiny_model(seed=2, num_experts=4)
    apply_recompute(model, "full")
    ids = torch.tensor([1, 2, 3, 4, 5])
    from miles.models import VarlenAttention

    trace = RoutingTrace(record=True)
    out = model.forward_packed(ids, torch.arange(5), VarlenAttention([0, 5]), trace)
    out.hidden.sum().backward()  # reruns both MoE layers
    assert len(trace.recorded) == 2


def test_policy_trainer_step_is_the_same_with_recompute() -> None:
    weights = []
    for mode in ("none", "full"):
        model = tiny_model(seed=2, num_experts=4)
        cfg = TrainerConfig(global_batch_size=6, micro_batch_tokens=24, recompute=mode)
        trainer = PolicyTrainer(model, cfg, AlgorithmConfig(), temperature=1.0)
        trainer.train_step(scored_samples(6))
        weights.append(copy.deepcopy(model.state_dict()))
    for name, want in weights[0].items():
        torch.testing.assert_close(weights[1][name], want, atol=1e-6, rtol=0, msg=name)


def test_unknown_recompute_mode_is_refused() -> None:
    with pytest.raises(MilesUserError, match="selective"):
        apply_recompute(tiny_model(), "layers")
