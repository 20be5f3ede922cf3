"""The sampler's block totals in one Triton pass over the logits.

`sampler.block_masses` needs the row maximum before it can sum exp(scaled - max) over each block of
tokens, so compiled it reads the [B, V] logits twice, and inductor runs each pass as one program per row
(152k tokens each, latency-bound: ~0.45 ms per decode step for batch 748 on the H200). Here every program
reads a few blocks once and keeps, per block, its own maximum m_b and s_b = sum exp(scaled - m_b); the
global maximum and the totals s_b * exp(m_b - max) (float64) then come from [B, blocks] tensors.

The totals equal `block_masses`' up to float rounding (each weight is exp(scaled - m_b) instead of
exp(scaled - max), through Triton's fast exp: a few float32 ulp, more far below the maximum); the draw inside
the chosen block recomputes its weights from the logits exactly as before, and the maximum is exact (a max
does not round). A NaN logit makes the row's totals NaN, as in `block_masses`.
"""

from __future__ import annotations

import logging

import torch

from miles.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled `block_masses` runs instead
    triton = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
kernel = fused.KernelSwitch("sampler block kernel", "using torch.compile", log)
_BLOCKS_PER_PROGRAM = 4

if triton is not None:

    @triton.jit
    def _block_max_sum_kernel(
        logits_ptr,  # [B, V], any float dtype, row stride stride_row
        temperature_ptr,  # [B] float32 (> 0)
        max_ptr,  # [B, NUM_BLOCKS] float32 out
        sum_ptr,  # [B, NUM_BLOCKS] float64 out
        vocab,
        stride_row,
        NUM_BLOCKS,
        BLOCK: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        temperature = tl.load(temperature_ptr + row)
        for i in tl.static_range(BLOCKS_PER_PROGRAM):
            block = tl.program_id(1) * BLOCKS_PER_PROGRAM + i
            if block < NUM_BLOCKS:
                cols = block * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
                scaled = tl.math.div_rn(x.to(tl.float32), temperature)  # rounded as torch divides
                top = tl.max(scaled, axis=0)
                # A block of only -inf logits (masked tokens) adds nothing; exp(-inf - -inf) would be NaN.
                weights = tl.where(scaled == float("-inf"), 0.0, tl.exp(scaled - top))
                total = tl.sum(weights.to(tl.float64), axis=0)
                tl.store(max_ptr + row * NUM_BLOCKS + block, top)
                tl.store(sum_ptr + row * NUM_BLOCKS + block, total)


def applies(logits: torch.Tensor) -> bool:
    return triton is not None and kernel.on and logits.is_cuda and logits.dim() == 2


def block_masses_kernel(
    logits: torch.Tensor, temperature: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max of logits / temperature [B, 1] float32, float64 totals of exp(scaled - max) per block of
    `block` tokens [B, blocks]), as `sampler.block_masses` returns them."""
    rows, vocab = logits.shape
    num_blocks = -(-vocab // block)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    block_sum = torch.empty(rows, num_blocks, dtype=torch.float64, device=logits.device)
    if rows:
        grid = (rows, triton.cdiv(num_blocks, _BLOCKS_PER_PROGRAM))
        _block_max_sum_kernel[grid](
            logits,
            temperature.float().contiguous(),
            block_max,
            block_sum,
            vocab,
            logits.stride(0),
            num_blocks,
            BLOCK=block,
            BLOCKS_PER_PROGRAM=_BLOCKS_PER_PROGRAM,
        )
    top = block_max.amax(dim=-1, keepdim=True)
    # exp(m_b - max) in float32, as `block_masses` weighs each token: a block whose largest weight underflows
    # to 0 there gets mass 0 here too, so the draw never picks a block whose recomputed weights are all 0.
    # Blocks of -inf (their sum is 0) scale by 0, not by exp(-inf - -inf).
    scale = torch.where(block_sum > 0, (block_max - top).exp().double(), 0.0)
    return top, block_sum * scale


def block_masses_or_none(
    logits: torch.Tensor, temperature: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's result where it applies and compiles; None sends the caller to the compiled function."""
    return kernel.run(block_masses_kernel, logits, temperature, block) if applies(logits) else None
