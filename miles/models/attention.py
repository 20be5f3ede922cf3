"""Attention contexts: how a forward pass reaches keys and values.

The model computes q/k/v (after q/k-norm and RoPE) and hands them to an `AttentionContext`; the context
decides where keys and values live. `VarlenAttention` is the training / full-forward path over packed
sequences; the rollout engine supplies contexts that read and write its paged KV cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from miles.models.fused import KernelSwitch


@dataclass
class KVWrite:
    """Where a layer's new keys and values go in a paged KV cache, for a kernel that writes them itself."""

    k_cache: torch.Tensor
    """[slots, Hkv, D] (any leading shape that flattens to it, contiguous)."""
    v_cache: torch.Tensor
    slots: torch.Tensor
    """[N] int64: the slot of each new token."""
    out: torch.Tensor | None = None
    """[N, Hq + Hk, D] contiguous: where the kernel puts the normed, rotated q/k (piecewise CUDA graphs keep
    it static, shared by every layer); None allocates."""


class AttentionContext(Protocol):
    def kv_write(self, layer_idx: int) -> KVWrite | None:
        """The layer's cache destination, where the caller may write k and v itself (then passing None for
        them to `attend`); None where `attend` must receive them."""
        ...

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] for the N new tokens (None: already written through
        `kv_write`); returns [N, Hq, D]."""
        ...


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention for one sequence: q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D].

    With `causal`, query i sees keys up to i + (Tk - Tq) (the queries are the last Tq positions).
    """
    tq, tk = q.shape[0], k.shape[0]
    if causal and mask is None and tq != tk:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


@functools.cache
def _flash_varlen() -> tuple[Callable[..., torch.Tensor], dict[str, Any]] | None:
    """torch's varlen flash attention and the keyword arguments of a causal call, or None without it.

    The signature moved between releases: torch 2.11 takes `window_size` and runs grouped-query heads as
    they are; later releases want `enable_gqa` (added per call) and some took `is_causal`.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        causal["enable_gqa"] = None  # set per call
    return varlen_attn, causal


FLASH = KernelSwitch("varlen flash attention", "running the SDPA paths")
"""Off after its first failure (e.g. a GPU or build without flash attention)."""


class VarlenAttention:
    """Causal attention within each of several sequences packed into one token dimension.

    `cu_seqlens` holds cumulative lengths ([0, len0, len0+len1, ...]). On CUDA in bf16/fp16 (or under
    autocast to one of them) the whole pack is one call of torch's varlen flash attention, forward and
    backward. Elsewhere short packs use one block-diagonal masked call (fewer kernel launches) and long
    packs go sequence by sequence to stay O(sum len^2).
    """

    block_mask_max_tokens = 2048
    use_flash = True
    """False: the SDPA paths on CUDA too (the reference the flash path is tested against)."""

    def __init__(self, cu_seqlens: list[int] | torch.Tensor) -> None:
        self.cu_seqlens = [int(x) for x in cu_seqlens]
        self._mask: torch.Tensor | None = None
        self._cu_device: torch.Tensor | None = None
        self._max_len = max((e - s for s, e in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])), default=0)

    def _flash_dtype(self, q: torch.Tensor) -> torch.dtype | None:
        """The half dtype the flash path runs in here, or None where it does not apply."""
        if not (self.use_flash and FLASH.on and q.is_cuda) or q.shape[-1] > 256 or q.shape[-1] % 8:
            return None
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        else:
            dtype = q.dtype
        if dtype not in (torch.bfloat16, torch.float16) or _flash_varlen() is None:
            return None
        return dtype

    def _flash(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype
    ) -> torch.Tensor:
        varlen_attn, causal = _flash_varlen()  # type: ignore[misc]
        if self._cu_device is None or self._cu_device.device != q.device:
            self._cu_device = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=q.device)
        kwargs = dict(causal)
        if "enable_gqa" in kwargs:
            kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
        cu, n = self._cu_device, self._max_len
        return varlen_attn(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, n, n, scale=scale, **kwargs)

    def _block_causal_mask(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            n = self.cu_seqlens[-1]
            seq_id = torch.zeros(n, dtype=torch.long, device=device)
            for boundary in self.cu_seqlens[1:-1]:
                seq_id[boundary:] += 1
            same_seq = seq_id[:, None] == seq_id[None, :]
            self._mask = same_seq & torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return self._mask

    def kv_write(self, layer_idx: int) -> None:
        return None  # no cache: keys and values come straight from the layer

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        assert k is not None and v is not None
        flash_dtype = self._flash_dtype(q)
        if flash_dtype is not None and q.shape[0]:
            out = FLASH.run(self._flash, q, k, v, scale, flash_dtype)  # None: no flash kernel on this GPU
            if out is not None:
                return out
        if len(self.cu_seqlens) == 2:
            return sdpa(q, k, v, scale, causal=True)
        if self.cu_seqlens[-1] <= self.block_mask_max_tokens:
            return sdpa(q, k, v, scale, causal=False, mask=self._block_causal_mask(q.device))
        outs = [
            sdpa(q[s:e], k[s:e], v[s:e], scale, causal=True)
            for s, e in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])
            if e > s
        ]
        return torch.cat(outs, dim=0)
