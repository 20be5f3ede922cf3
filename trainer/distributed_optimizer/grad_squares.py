"""A gradient's sum of squares in float64 without a float64 copy of the whole gradient.

`grad.double().square().sum()` allocates two float64 tensors of the gradient's size: on the Qwen3-30B-A3B
shape's expert bucket (604 M parameters a layer) 16 bytes a parameter at once, the 36 GiB allocation that
ran an 8-layer update out of memory. Summing chunk by chunk keeps the float64 accumulation and bounds the
temporaries to one chunk.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24
"""Elements squared at a time: 128 MiB of float64 temporaries per chunk."""


def sum_of_squares(grad: torch.Tensor, chunk: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """sum(grad ** 2) as a float64 scalar on grad's device, accumulated one chunk of elements at a time."""
    flat = grad.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for start in range(0, flat.numel(), chunk):
        total += flat[start : start + chunk].double().square().sum()
    return total
