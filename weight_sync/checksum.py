"""Bit-exact fingerprints of named tensors, to prove trainer and engine hold the same weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_fingerprint(tensor: torch.Tensor) -> int:
    """Position-weighted sum of the raw bits (wrapping int64): any changed element changes it."""
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1_000_003 + 1
    return int((bits * weights).sum().item())


def fingerprints(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, int]:
    return {name: tensor_fingerprint(t if dtype is None else t.to(dtype)) for name, t in named}


def compare(expected: dict[str, int], actual: dict[str, int]) -> list[str]:
    """Names whose fingerprints differ or that one side lacks."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) != actual.get(n))
