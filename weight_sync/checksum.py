"""Bit-exact fingerprints of named tensors, to prove trainer and engine hold the same weights."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""Integer views of the raw bits. Wider elements (float64, int64, complex) are read as int32 halves: an
int64 word times a position weight wraps modulo 2**64, so a flip of its top bit (float64's sign) times an
even weight would vanish; a 32-bit half times a weight below 2**21 never wraps."""


FINGERPRINT_CHUNK = 1 << 22
"""Elements fingerprinted at once: the int64 temporary takes 8 bytes an element, which for a whole Qwen3-8B
embedding (622M elements) would be ~5 GB next to the KV pool."""

_MODULUS = 1_000_003
"""Position i (1-based) weighs i % _MODULUS + 1."""


@functools.lru_cache(maxsize=8)
def _position_weights(device: torch.device) -> torch.Tensor:
    """w[k] = k % _MODULUS + 1 for k < FINGERPRINT_CHUNK + _MODULUS: the weights of any chunk are a slice of
    it (no int64 modulo per element, the costliest part of a fingerprint). 40 MB per device, kept."""
    return torch.arange(FINGERPRINT_CHUNK + _MODULUS, device=device, dtype=torch.int64) % _MODULUS + 1


def tensor_fingerprint(tensor: torch.Tensor, chunk: int = FINGERPRINT_CHUNK) -> int:
    """Position-weighted sum of the raw bits (wrapping int64): any changed element changes it. Summed a
    `chunk` of elements at a time; int64 addition wraps, so the value does not depend on the chunk size."""
    return int(fingerprint_on_device(tensor, chunk=chunk).item())


def fingerprint_on_device(
    tensor: torch.Tensor, first: int = 0, chunk: int = FINGERPRINT_CHUNK
) -> torch.Tensor:
    """`tensor_fingerprint` as a 0-d int64 tensor on the tensor's device, read by nobody yet: a sync
    fingerprints hundreds of tensors and reads them all at once, not with a host round trip each.

    `first`: the index of the tensor's first element in a larger flat tensor it is a piece of. The
    fingerprints of the pieces of a tensor, summed (wrapping int64), are the whole tensor's."""
    flat = tensor.detach().contiguous().view(-1)
    size = flat.element_size()
    if size in _INT_VIEW:
        bits = flat.view(_INT_VIEW[size])
    else:  # 8 or 16 bytes an element: its 32-bit words
        bits = flat.view(torch.uint8).view(torch.int32)
        chunk *= size // 4
        first *= size // 4
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    chunk = max(1, min(chunk, FINGERPRINT_CHUNK))  # the value does not depend on it; the weights' table does
    weights = _position_weights(bits.device)
    products = torch.empty(min(chunk, bits.numel()), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk]
        at = (first + start + 1) % _MODULUS
        out = products[: part.numel()]
        torch.mul(part, weights[at : at + part.numel()], out=out)  # exact: below 2**31 times 2**20
        total += out.sum()
    return total


def fingerprints(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, int]:
    return {name: tensor_fingerprint(t if dtype is None else t.to(dtype)) for name, t in named}


def compare(expected: dict[str, int], actual: dict[str, int]) -> list[str]:
    """Names whose fingerprints differ or that one side lacks."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) != actual.get(n))
