"""Activation recomputation (`trainer.recompute`): activations dropped after the forward and recomputed in
the backward, trading one more forward of the wrapped parts for their memory.

- `full`: each decoder layer keeps only its inputs; the whole layer runs again in the backward.
- `selective`: each layer's attention block and MLP (a MoE layer's router and experts) keep only their
  inputs: the projections, attention and activation-function intermediates, which dominate a layer's
  activations, are recomputed; the residual stream and norms stay.

The same `torch.utils.checkpoint` (non-reentrant) wrapping serves our `CausalLM` and megatron-core's
`TransformerLayer`s. Megatron's own `recompute_granularity` is not used: its checkpoint function saves and
restores CUDA RNG state, so it fails on a CPU-only machine, where this one is tested; the model has no
dropout, so nothing random needs replaying either. Forwards without grad (the engine's, old logprobs) run the
layers as they are. Gradients are those of the plain forward (checked to 1e-6 in the tests).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from miles.errors import MilesUserError

RECOMPUTE_MODES = ("none", "selective", "full")
_ORIGINALS = "_miles_recompute_originals"
"""Per wrapped module: {method name: the method before wrapping}, so a mode can be undone or changed."""


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise MilesUserError(f"unknown trainer.recompute={mode!r}; use one of {', '.join(RECOMPUTE_MODES)}")


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Wrap `model`'s layers for `mode` (replacing an earlier mode); returns the number of wrapped parts."""
    check_recompute(mode)
    for module in model.modules():
        for attr, original in module.__dict__.pop(_ORIGINALS, {}).items():
            if original is None:
                delattr(module, attr)
            else:
                setattr(module, attr, original)
    if mode == "none":
        return 0
    targets = _targets(model, mode)
    if not targets:
        raise MilesUserError(
            f"trainer.recompute={mode}: found no decoder layers in {type(model).__name__} to recompute"
        )
    for module, attr in targets:
        _wrap(module, attr)
    return len(targets)


def _targets(model: nn.Module, mode: str) -> list[tuple[nn.Module, str]]:
    from miles.models.model import DecoderLayer

    targets: list[tuple[nn.Module, str]] = []
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            if mode == "full":
                targets.append((layer, "forward"))
            else:
                targets += [(layer.self_attn, "forward"), (layer.mlp, "delta" if layer.is_moe else "forward")]
        elif _is_megatron_layer(layer):
            if mode == "full":
                targets.append((layer, "forward"))
            else:
                targets += [(layer.self_attention, "forward"), (layer.mlp, "forward")]
    return targets


def _is_megatron_layer(module: nn.Module) -> bool:
    layers = sys.modules.get("megatron.core.transformer.transformer_layer")  # imported by a megatron policy
    return layers is not None and isinstance(module, layers.TransformerLayer)


def _wrap(module: nn.Module, attr: str) -> None:
    # The instance attribute (None when the method comes from the class) is restored on unwrapping.
    module.__dict__.setdefault(_ORIGINALS, {})[attr] = module.__dict__.get(attr)
    original: Callable[..., Any] = getattr(module, attr)

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        calls = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:  # the backward's rerun: a routing trace must not record the experts twice
                a, k = tuple(_quiet(x) for x in a), {key: _quiet(v) for key, v in k.items()}
            return original(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    setattr(module, attr, recomputed)


def _quiet(value: Any) -> Any:
    from miles.models.moe import RoutingTrace

    if isinstance(value, RoutingTrace) and value.record:
        return dataclasses.replace(value, record=False, recorded=[])
    return value
