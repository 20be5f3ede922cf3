"""Bit-exact fingerprints of named tensors, to prove trainer and engine hold the same weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""Integer views of the raw bits. Wider elements (float64, int64, complex) are read as int32 halves: an
int64 word times a position weight wraps modulo 2**64, so a flip of its top bit (float64's sign) times an
even weight would vanish; a 32-bit half times a weight below 2**21 never wraps."""


FINGERPRINT_CHUNK = 1 << 24
"""Elements fingerprinted at once: the int64 temporaries take ~32 bytes an element, which for a whole
Qwen3-8B embedding (622M elements) would be ~20 GB next to the KV pool."""


def tensor_fingerprint(tensor: torch.Tensor, chunk: int = FINGERPRINT_CHUNK) -> int:
    """Position-weighted sum of the raw bits (wrapping int64): any changed element changes it. Summed a
    `chunk` of elements at a time; int64 addition wraps, so the value does not depend on the chunk size."""
    flat = tensor.detach().contiguous().view(-1)
    size = flat.element_size()
    if size in _INT_VIEW:
        bits = flat.view(_INT_VIEW[size])
    else:  # 8 or 16 bytes an element: its 32-bit words
        bits = flat.view(torch.uint8).view(torch.int32)
        chunk *= size // 4
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk].to(torch.int64)
        weights = torch.arange(start + 1, start + part.numel() + 1, device=bits.device, dtype=torch.int64)
        total += (part * (weights % 1_000_003 + 1)).sum()
    return int(total.item())


def fingerprints(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, int]:
    return {name: tensor_fingerprint(t if dtype is None else t.to(dtype)) for name, t in named}


def compare(expected: dict[str, int], actual: dict[str, int]) -> list[str]:
    """Names whose fingerprints differ or that one side lacks."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) != actual.get(n))
