"""The tensor bytes a trainer holds, by part, read from its own tensors: what `python -m
miles.bench.memory_plan --json-out` records beside the device peaks, and `miles.bench.memory_table`
extrapolates per layer.

- weights: the policy's parameters (this rank's parts of them);
- gradients: what is summed when the update starts (the distributed optimizer's float32 flat buffers, the
  master weights' float32 gradients, or the parameters' own), read by wrapping the trainer's update;
- optimizer state: float32 masters and AdamW moments (`OptimizerOffload.state_tensors`);
- engine copy: the separate `CausalLM` a policy that is not the engine's module (megatron) is built from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.sample import Sample
from miles.trainer.packing import fed_length, plan_micro_batches


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gradient_bytes(trainer: Any) -> int:
    """Bytes of the gradients `trainer` holds now."""
    if trainer.sharded is not None:
        return tensor_bytes(b.grad for b in trainer.sharded.buckets if b.grad is not None)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if trainer.masters is not None:
        masters = zip(trainer.masters.params, trainer.masters.masters)
        grads += [m.grad for p, m in masters if m is not p and m.grad is not None]
    return tensor_bytes(grads)


class GradientProbe:
    """The most gradient bytes `trainer` held when an update began (all its micro-batches summed by then)."""

    def __init__(self, trainer: Any) -> None:
        self.most = 0
        trainer.before_update.append(lambda: self._read(trainer))

    def _read(self, trainer: Any) -> None:
        self.most = max(self.most, gradient_bytes(trainer))


def largest_micro_batch_tokens(samples: list[Sample], micro_batch_tokens: int) -> int:
    """Tokens of the largest packed micro-batch the trainer makes of `samples` (the activations' size)."""
    lengths = [fed_length(s) for s in samples]
    return max(sum(lengths[i] for i in batch) for batch in plan_micro_batches(lengths, micro_batch_tokens))


def state_parts(
    trainer: Any, engine_model: nn.Module, probe: GradientProbe, state_bytes: int
) -> dict[str, int]:
    """This rank's weights, gradients, optimizer state and engine copy, in bytes."""
    policy = trainer.model
    return {
        "weight_bytes": tensor_bytes(policy.parameters()),
        "grad_bytes": probe.most,
        "optimizer_state_bytes": state_bytes,
        "engine_copy_bytes": 0 if engine_model is policy else tensor_bytes(engine_model.parameters()),
    }


def parameter_counts(args: Any) -> dict[str, int]:
    """Parameters of one decoder layer (and its experts' share) and outside the layers, from the shape."""
    from miles.models import CausalLM

    with torch.device("meta"):
        model = CausalLM(args)
    layer = expert = outside = 0
    for name, param in model.named_parameters():
        if name.startswith("model.layers.0."):
            layer += param.numel()
            expert += param.numel() if ".mlp.experts." in name else 0
        elif not name.startswith("model.layers."):
            outside += param.numel()
    return {"layer": layer, "layer_experts": expert, "outside_layers": outside}
