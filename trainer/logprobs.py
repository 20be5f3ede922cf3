"""Per-token logprobs (and entropy) of the response tokens of a packed micro-batch.

Logits are computed only at the rows that predict response tokens (prompt rows never reach the LM head),
and a chunk of rows at a time (recomputed in the backward), so a large vocabulary never holds [tokens, vocab]
float32 tensors for autograd. The LM-head GEMM runs in the trainer's precision (bf16 operands for
`precision=bf16`, as a bf16 engine model computes its logits; float32 GEMMs are ~5x slower on an H200),
and the softmax always in float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.models import CausalLM, RoutingTrace, VarlenAttention, fused
from miles.trainer.logit_gradient import add_weight_gradient, logit_gradient
from miles.trainer.packing import MicroBatch

PRECISIONS = ("fp32", "bf16")


FUSED_KERNELS = ("auto", "on", "off")


def use_fused_kernels(setting: str, device: torch.device, precision: str) -> bool:
    """`trainer.fused_kernels` resolved: compiling the elementwise chains pays off on a GPU in bf16, where
    eager float32 norms, adds and casts take ~40 % of an update's kernel time (docs/benchmarks.md)."""
    if setting not in FUSED_KERNELS:
        raise ValueError(f"unknown trainer.fused_kernels {setting!r}; use one of {', '.join(FUSED_KERNELS)}")
    if setting == "auto":
        return device.type == "cuda" and precision == "bf16"
    return setting == "on"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown trainer.precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor
    """[M] log pi(token) under logits / temperature, float32."""
    entropy: torch.Tensor | None = None
    """[M] entropy of the temperature-scaled next-token distribution, float32."""


def packed_logprobs(
    model: CausalLM,
    batch: MicroBatch,
    temperature: float = 1.0,
    precision: str = "fp32",
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused_kernels: bool = False,
) -> TokenLogprobs:
    """Forward one micro-batch and return logprobs of its response tokens (grad follows the caller's mode).

    `fused_kernels` runs the model's elementwise chains compiled (miles.models.fused), their backward too."""
    if temperature <= 0:
        raise ValueError(f"logprobs need a positive temperature, got {temperature}")
    own = getattr(model, "packed_logprobs", None)
    if own is not None:  # a DeepSpeed policy runs this inside its engine's forward (ZeRO-3 gathers there)
        return own(batch, temperature, precision, with_entropy, entropy_grad)
    routing = (
        RoutingTrace(record=False, replay=batch.routing_replay) if batch.routing_replay is not None else None
    )
    with autocast(batch.input_ids.device, precision), fused.compiled_chains(fused_kernels):
        out = model.forward_packed(
            batch.input_ids, batch.positions, VarlenAttention(batch.cu_seqlens), routing
        )
    compute_dtype = torch.bfloat16 if precision == "bf16" else model.dtype
    hidden = out.hidden[batch.target_rows].to(compute_dtype)
    logprobs, entropy = chunked_logprobs(
        hidden,
        model.lm_head.weight,
        batch.targets,
        temperature,
        with_entropy,
        entropy_grad,
        group=getattr(model, "tensor_parallel_group", None),
        vocab_size=model.args.vocab_size,
    )
    return TokenLogprobs(logprobs=logprobs, entropy=entropy)


_CHUNK_BYTES = {"cuda": 512 * 1024 * 1024, "cpu": 256 * 1024 * 1024}
"""float32 logits of one chunk: [rows, vocab] of about this size (1 chunk for small vocabularies); a chunk's
forward and backward hold at most 2 such buffers at once. Larger on CUDA, where ~900-row LM-head GEMMs at a 152k
vocabulary run the logprobs ~1.3x faster than 440-row ones (1,800 rows: another ~10 %)."""


def chunk_rows(vocab_size: int, chunk_bytes: int | None = None, device: torch.device | None = None) -> int:
    if chunk_bytes is None:
        chunk_bytes = _CHUNK_BYTES["cuda" if device is not None and device.type == "cuda" else "cpu"]
    return max(1, chunk_bytes // (4 * vocab_size))


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    rows_per_chunk: int | None = None,
    group: Any = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / T)[target] (and the entropy) per row, float32.

    With a TP `group`, `weight` is this rank's rows of a vocabulary split over the group
    (trainer/vocab_parallel.py), padded past `vocab_size` with rows the softmax leaves out; chunks are sized
    by the whole vocabulary's logits, as without.

    The GEMMs run in `hidden`'s dtype (the weight is cast to it, once per pass). The [rows, vocab] float32
    logits exist one chunk of rows at a time, in the forward and again in the backward (recomputed), instead
    of several whole copies kept for autograd: with a 152k vocabulary and 16k response tokens that is tens
    of GB on a GPU.
    """
    if group is not None:
        from miles.trainer.vocab_parallel import vocab_parallel_logprobs

        padded = weight.shape[0] * dist.get_world_size(group)
        rows = rows_per_chunk or chunk_rows(padded, device=hidden.device)
        logprobs, entropy = vocab_parallel_logprobs(
            hidden,
            weight,
            targets,
            group,
            temperature,
            rows,
            with_entropy,
            entropy_grad,
            vocab_size or padded,
        )
        return logprobs, (entropy if with_entropy else None)
    rows = rows_per_chunk or chunk_rows(weight.shape[0], device=hidden.device)
    entropy_grad = entropy_grad and with_entropy and torch.is_grad_enabled()
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden, weight, targets, temperature, rows, with_entropy, entropy_grad
    )
    return logprobs, (entropy if with_entropy else None)


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q [rows, vocab] float32, log q[target] [rows]) of one chunk; the logits and log q are the only
    [rows, vocab] float32 buffers, and the logits are freed on return."""
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:  # divided, as the engine's sampler does, so both round alike (in place: same bits)
        logits.div_(temperature)
    log_q = F.log_softmax(logits, dim=-1)
    return log_q, log_q.gather(-1, targets[:, None]).squeeze(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        rows: int,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(hidden.dtype)
        for s in range(0, n, rows):
            log_q, picked = _chunk_stats(hidden[s : s + rows], w, targets[s : s + rows], temperature)
            logprobs[s : s + rows] = picked
            if with_entropy:  # q * log q written over q: the same products, one buffer fewer
                entropy[s : s + rows] = -log_q.exp().mul_(log_q).sum(-1)
            del log_q  # before the next chunk's logits exist
        # the backward's entropy term reads these values (its recomputed chunk rounds alike) instead of
        # summing q * log q into a third [rows, vocab] buffer
        saved_entropy = entropy.clone() if entropy_grad else entropy.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, saved_entropy)
        ctx.temperature, ctx.rows, ctx.entropy_grad = temperature, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, rows = ctx.temperature, ctx.rows  # type: ignore[attr-defined]
        use_entropy = ctx.entropy_grad and grad_entropy is not None  # type: ignore[attr-defined]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # a frozen lm_head needs no [vocab, hidden] float32 buffer
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.to(hidden.dtype)
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            log_q, _ = _chunk_stats(h, w, targets[s : s + rows], temperature)
            q = log_q.exp()
            g = grad_logprobs[s : s + rows]
            ent = entropy[s : s + rows] if use_entropy else None
            grad_ent = grad_entropy[s : s + rows] if use_entropy else None  # type: ignore[index]
            grad = logit_gradient(log_q, q, g, targets[s : s + rows], g, ent, grad_ent, temperature)
            del log_q, q  # grad is q's buffer
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s : s + rows] = grad @ w
            if grad_weight is not None:
                add_weight_gradient(grad_weight, grad, h)
            del grad  # before the next chunk's logits exist
        grad_w = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_w, None, None, None, None, None
