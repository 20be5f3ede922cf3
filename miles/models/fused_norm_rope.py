"""Qwen3's per-head q/k RMSNorm followed by RoPE, for all q and k heads of a token in one Triton kernel.

`torch.compile` splits `fused.qk_norm_rope` into a reduction kernel and a rotation kernel (the rotation
reads the normalised row in another order), and its choice of reduction kernel varied between compiles:
0.4 to 0.9 ms per decode step for Qwen3-30B-A3B at batch 748 on the H200. Here one program normalises and
rotates one token's heads, reading q and k once and writing them once.

Rounding follows the eager functions in `fused` (the norm in float32, rounded before the weight; each RoPE
product and the sum rounded to bfloat16), so only the float32 reduction order differs. Each intermediate
rounding is done on the float32 bits (round to nearest, ties to even), not as a cast to bfloat16 and back.
With casts, this kernel's norm matched eager on the H200 but its RoPE outputs differed by one step on ~16 %
of the elements: the compiler may narrow `float(bf16(a * b)) + float(bf16(c * d))` to bfloat16 arithmetic
and fuse a product into an fma, which skips that product's rounding. Integer bit operations cannot be
narrowed or fused.
"""

from __future__ import annotations

import logging

import torch

from miles.models import fused

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled or eager functions run instead
    triton = None  # type: ignore[assignment]

_disabled = False


if triton is not None:

    @triton.jit
    def _round_bf16(x):
        """float32 -> the nearest bfloat16 value (ties to even, overflow to inf), kept in float32."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x)  # a NaN's carry could wrap around

    @triton.jit
    def _qk_norm_rope_kernel(
        x_ptr,  # [N, H, D] q heads then k heads (row stride stride_xn, head stride stride_xh)
        out_ptr,  # [N, H, D] contiguous
        q_weight_ptr,  # [D]
        k_weight_ptr,  # [D]
        cos_ptr,  # [N, D]
        sin_ptr,  # [N, D]
        stride_xn,
        stride_xh,
        stride_cn,
        num_q_heads,
        num_heads,
        eps,
        HEADS: tl.constexpr,  # num_heads rounded up to a power of two
        HALF: tl.constexpr,  # D // 2
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS)
        cols = tl.arange(0, HALF)
        ok = (heads < num_heads)[:, None]
        src = x_ptr + row * stride_xn + heads[:, None] * stride_xh + cols[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        scale = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        is_q = (heads < num_q_heads)[:, None]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + cols)[None, :], tl.load(k_weight_ptr + cols)[None, :])
        w2 = tl.where(
            is_q, tl.load(q_weight_ptr + HALF + cols)[None, :], tl.load(k_weight_ptr + HALF + cols)[None, :]
        )
        h1 = _round_bf16(w1.to(tl.float32) * _round_bf16(x1 * scale[:, None]))
        h2 = _round_bf16(w2.to(tl.float32) * _round_bf16(x2 * scale[:, None]))
        cos1 = tl.load(cos_ptr + row * stride_cn + cols).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + row * stride_cn + HALF + cols).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + row * stride_cn + cols).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + row * stride_cn + HALF + cols).to(tl.float32)[None, :]
        o1 = _round_bf16(_round_bf16(h1 * cos1) + _round_bf16(-h2 * sin1))
        o2 = _round_bf16(_round_bf16(h2 * cos2) + _round_bf16(h1 * sin2))
        dst = out_ptr + row * num_heads * (2 * HALF) + heads[:, None] * (2 * HALF) + cols[None, :]
        # Exactly representable: the store's conversion does not round again.
        tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=ok)


def shapes_fit(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """The layout the kernel assumes: bf16 throughout, unit stride along the head dim, half a head a power of
    two, weights [D], cos/sin [N, D] (the eager function would promote or broadcast others)."""
    num_tokens, dim = qk.shape[0], qk.shape[-1]
    half = dim // 2
    return (
        qk.dtype == torch.bfloat16
        and qk.stride(-1) == 1
        and dim % 2 == 0
        and half & (half - 1) == 0
        and all(w.dtype == torch.bfloat16 and w.shape == (dim,) for w in (q_weight, k_weight))
        and all(t.dtype == torch.bfloat16 and t.shape == (num_tokens, dim) for t in (cos, sin))
    )


def applies(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """The engine's bf16 forwards on CUDA with fused kernels on (the kernel has no backward; fp16 models take
    the compiled function)."""
    return (
        triton is not None
        and not _disabled
        and fused.enabled()
        and qk.is_cuda
        and not torch.is_grad_enabled()
        and shapes_fit(qk, q_weight, k_weight, cos, sin)
    )


def qk_norm_rope_kernel(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`fused.qk_norm_rope` as one Triton kernel: [N, Hq + Hk, D] (any row and head strides) -> contiguous."""
    num_tokens, heads, dim = qk.shape
    out = torch.empty(num_tokens, heads, dim, dtype=qk.dtype, device=qk.device)
    if num_tokens == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rope_kernel[(num_tokens,)](
        qk,
        out,
        q_weight,
        k_weight,
        cos,
        sin,
        qk.stride(0),
        qk.stride(1),
        cos.stride(0),
        num_q_heads,
        heads,
        eps,
        HEADS=triton.next_power_of_2(heads),
        HALF=dim // 2,
    )
    return out


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The Triton kernel where it applies, else `fused.qk_norm_rope` (compiled inside `fused_kernels()`)."""
    global _disabled
    if applies(qk, q_weight, k_weight, cos, sin):
        try:
            return qk_norm_rope_kernel(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # Triton cannot compile here: the compiled function computes the same
            _disabled = True
            log.warning(
                "q/k norm+RoPE kernel unavailable (%s: %s); using torch.compile", type(err).__name__, err
            )
    return fused.call(fused.qk_norm_rope, qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
