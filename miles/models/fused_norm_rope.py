"""Qwen3's per-head q/k RMSNorm followed by RoPE, for all q and k heads of a token in one Triton kernel.

`torch.compile` splits `fused.qk_norm_rope` into a reduction kernel and a rotation kernel (the rotation
reads the normalised row in another order), and its choice of reduction kernel varied between compiles:
0.4 to 0.9 ms per decode step for Qwen3-30B-A3B at batch 748 on the H200. Here one launch normalises and
rotates every q and k head (a program per block of one token's heads), reading them once and writing them
once.

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
import math

import torch

from miles.models import fused
from miles.models.attention import KVWrite

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled or eager functions run instead
    triton = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
kernel = fused.KernelSwitch("q/k norm+RoPE kernel", "using torch.compile", log)
# Its own switch: a failure of the KV-writing variant leaves the plain kernel on (not the reverse: the
# variant needs the plain kernel's `applies`).
kv_write_kernel = fused.KernelSwitch(
    "q/k kernel with the KV write", "writing the cache through `attend`", log
)


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
        v_ptr,  # [N, Hk, D] (row stride stride_vn, head stride stride_vh); with WRITE_KV only
        stride_vn,
        stride_vh,
        k_cache_ptr,  # [slots, Hk, D] contiguous; with WRITE_KV only
        v_cache_ptr,
        slots_ptr,  # [N]
        HB: tl.constexpr,  # heads per program: divides both Hq and Hk, so a block is all q or all k
        HALF: tl.constexpr,  # D // 2
        WRITE_KV: tl.constexpr,  # also store the token's rotated k and its v at its cache slot
    ):
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * HB
        heads = first + tl.arange(0, HB)
        cols = tl.arange(0, HALF)
        src = x_ptr + row * stride_xn + heads[:, None] * stride_xh + cols[None, :]
        x1 = tl.load(src).to(tl.float32)
        x2 = tl.load(src + HALF).to(tl.float32)
        scale = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        is_q = first < num_q_heads
        w1 = tl.where(is_q, tl.load(q_weight_ptr + cols), tl.load(k_weight_ptr + cols))[None, :]
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + cols), tl.load(k_weight_ptr + HALF + cols))[None, :]
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
        tl.store(dst, o1.to(out_ptr.dtype.element_ty))
        tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty))
        if WRITE_KV:
            if first >= num_q_heads:  # a block of k heads
                kv_heads = (heads - num_q_heads)[:, None]
                num_kv_heads = num_heads - num_q_heads
                slot_base = tl.load(slots_ptr + row).to(tl.int64) * num_kv_heads * (2 * HALF)
                k_dst = k_cache_ptr + slot_base + kv_heads * (2 * HALF) + cols[None, :]
                tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty))
                tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty))
                dims = tl.arange(0, 2 * HALF)[None, :]
                v = tl.load(v_ptr + row * stride_vn + kv_heads * stride_vh + dims)
                tl.store(v_cache_ptr + slot_base + kv_heads * (2 * HALF) + dims, v)


def heads_per_program(num_q_heads: int, num_kv_heads: int) -> int:
    """The largest power of two (at most 8) dividing both head counts: one program normalises that many heads
    of one token. One program per token, with the head count padded to a power of two, ran 15 us per layer
    (Qwen3-30B-A3B, batch 736, H200): 36 heads padded to 64, too many registers per thread."""
    common = math.gcd(num_q_heads, num_kv_heads)
    return min(8, common & -common)


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
        and kernel.on
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
    v: torch.Tensor | None = None,
    kv_write: KVWrite | None = None,
) -> torch.Tensor:
    """`fused.qk_norm_rope` as one Triton kernel: [N, Hq + Hk, D] (any row and head strides) -> contiguous.
    With `v` and `kv_write`, each token's rotated k and its v also go to its slot of the caches."""
    num_tokens, heads, dim = qk.shape
    out = kv_write.out if kv_write is not None else None
    if out is None:
        out = torch.empty(num_tokens, heads, dim, dtype=qk.dtype, device=qk.device)
    assert out.shape == qk.shape and out.dtype == qk.dtype and out.is_contiguous(), "bad q/k output buffer"
    if num_tokens == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    write_kv = v is not None and kv_write is not None
    if write_kv:
        assert v is not None and kv_write is not None
        v_arg, k_cache, v_cache, slots = v, kv_write.k_cache, kv_write.v_cache, kv_write.slots
        stride_vn, stride_vh = v.stride(0), v.stride(1)
    else:  # unused pointers (the branch is compiled out)
        v_arg = k_cache = v_cache = slots = qk
        stride_vn = stride_vh = 0
    block = heads_per_program(num_q_heads, heads - num_q_heads)
    _qk_norm_rope_kernel[(num_tokens, heads // block)](
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
        v_arg,
        stride_vn,
        stride_vh,
        k_cache,
        v_cache,
        slots,
        HB=block,
        HALF=dim // 2,
        WRITE_KV=write_kv,
        num_warps=max(1, min(4, block * dim // 512)),
    )
    return out


def cache_fits(qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, kv_write: KVWrite) -> bool:
    """The caches the kernel can write: qk's dtype and device, contiguous [..., Hk, D] (k and v alike), v with
    unit stride along D, one slot per token."""
    num_tokens, heads, dim = qk.shape
    num_kv_heads = heads - num_q_heads
    return (
        all(
            c.dtype == qk.dtype
            and c.device == qk.device
            and c.is_contiguous()
            and c.shape[-2:] == (num_kv_heads, dim)
            for c in (kv_write.k_cache, kv_write.v_cache)
        )
        and kv_write.k_cache.shape == kv_write.v_cache.shape
        and kv_write.slots.device == qk.device
        and v.dtype == qk.dtype
        and v.shape == (num_tokens, num_kv_heads, dim)
        and v.stride(-1) == 1
        and kv_write.slots.shape == (num_tokens,)
        and not kv_write.slots.is_floating_point()
    )


def qk_norm_rope_into_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_write: KVWrite,
) -> torch.Tensor | None:
    """The kernel with the layer's KV-cache write folded in (one launch instead of three: the rotated k and
    v go straight to their slots). None where the kernel does not apply; the caller then runs
    `qk_norm_rope` and hands k and v to the attention context to write."""
    if not (
        kv_write_kernel.on
        and applies(qk, q_weight, k_weight, cos, sin)
        and cache_fits(qk, v, num_q_heads, kv_write)
    ):
        return None
    return kv_write_kernel.run(
        qk_norm_rope_kernel, qk, q_weight, k_weight, num_q_heads, eps, cos, sin, v, kv_write
    )


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The Triton kernel where it applies, else `fused.qk_norm_rope` (compiled inside `fused_kernels()`;
    eager without autograd, its in-place form)."""
    if applies(qk, q_weight, k_weight, cos, sin):
        out = kernel.run(qk_norm_rope_kernel, qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
        if out is not None:
            return out
    # In place only where the weights have qk's dtype: float32 weights on bf16 activations (autocast) promote
    # the product to float32, which an in-place product would round back.
    if not fused.compiling() and not torch.is_grad_enabled() and q_weight.dtype == k_weight.dtype == qk.dtype:
        return fused.qk_norm_rope_inference(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
    return fused.call(fused.qk_norm_rope, qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
