"""Loading new weights into the engine's model: model or Hugging Face names, as a dict, pairs or buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from miles.models.checkpoint import hf_to_internal
from miles.models.model import CausalLM

WeightsInput = (
    Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[Mapping[str, torch.Tensor]]
)


def load_weights(model: CausalLM, weights: WeightsInput) -> None:
    """Copy every given tensor into the model's parameter of that name (shapes must match)."""
    args = model.args
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in hf_to_internal(named_tensors(weights), args):
            target = params.get(name)
            if target is None:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of this {args.model_type} model "
                    "(names look like 'model.layers.0.self_attn.o_proj.weight'; Hugging Face's q/k/v_proj and "
                    "gate/up_proj are accepted and stacked)"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}"
                )
            target.copy_(tensor)


def named_tensors(weights: WeightsInput) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(weights, Mapping):
        yield from weights.items()
        return
    for item in weights:
        if isinstance(item, Mapping):
            yield from item.items()
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item  # type: ignore[misc]
        elif isinstance(item, (list, tuple)):
            yield from item
        else:
            raise TypeError(
                f"update_weights takes a dict, (name, tensor) pairs or buckets of them, got {type(item)}"
            )
