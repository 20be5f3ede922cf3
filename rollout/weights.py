"""Loading new weights into the engine's model: model or Hugging Face names, as a dict, pairs or buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from miles.models.checkpoint import copy_named_tensors
from miles.models.model import CausalLM

WeightsInput = (
    Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[Mapping[str, torch.Tensor]]
)


def load_weights(model: CausalLM, weights: WeightsInput) -> set[tuple[str, str]]:
    """Copy every given tensor into its place in the model (shapes must match); any subset may be given.
    Returns the places written, as (parameter name, index) pairs."""
    return copy_named_tensors(model, named_tensors(weights), "update_weights")


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
