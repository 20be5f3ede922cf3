"""Logprobs and entropy when the LM head is split over the vocabulary (megatron's tensor parallelism).

Each TP rank holds rows `[rank * V/tp, (rank + 1) * V/tp)` of the output projection, so it computes only
those logits. The softmax's max and normaliser, the target's logit and the entropy's `sum p (z - max)` are
all-reduced over the TP group, a [rows] vector each; the [rows, vocab] logits never leave their rank. Every
sum is over logits shifted by the max, as `log_softmax` computes them: `log Z - sum p z` in unshifted logits
cancels catastrophically once the logits are large (float32 rounds `log Z` to ulp(max)). The backward
recomputes each chunk's local logits from the saved max and log-normaliser and the entropy, and all-reduces
the hidden-state gradient (every rank's part of `grad @ W`). Chunked like `chunked_logprobs`, whose values
and gradients these equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.trainer.logit_gradient import add_weight_gradient, logit_gradient


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: Any,
    temperature: float,
    rows_per_chunk: int,
    with_entropy: bool,
    entropy_grad: bool,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(target), entropy) per row, float32, with `weight` this rank's [V/tp, H] vocabulary rows; rows
    at or past `vocab_size` (padding that makes the vocabulary split evenly) are left out of the softmax."""
    entropy_grad = entropy_grad and with_entropy and torch.is_grad_enabled()
    check_token_ids(targets, vocab_size, "target")
    return _VocabParallelLogprobs.apply(
        hidden, weight, targets, group, temperature, rows_per_chunk, with_entropy, entropy_grad, vocab_size
    )


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Token ids must lie in the model's vocabulary. Split over TP ranks, an id past it would otherwise get a
    number silently: in the padding rows an embedding of zeros or a logprob of -1e30, past them (or negative)
    no rank's column, so a logprob of `-log Z`; one process's lookup raises an index error instead. On CUDA
    the check is asynchronous (a device assertion, as an out-of-range index there), with no host sync."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    message = f"a {what} token id lies outside the model's vocabulary of {vocab_size} tokens"
    if ids.device.type == "cpu":
        if bool(bad.any()):
            first = int(ids[bad][0])
            raise ValueError(f"{message} (e.g. {first}); check that the tokenizer matches the model")
    else:
        torch._assert_async(~bad.any(), message)


_PADDED_LOGIT = -1e30
"""A padding column's logit: exp() of it is exactly 0, and unlike -inf it keeps 0 * logit finite."""


def _local_logits(
    h: torch.Tensor, w: torch.Tensor, temperature: float, start: int, vocab_size: int
) -> torch.Tensor:
    logits = F.linear(h, w).float()
    if temperature != 1.0:
        logits = logits / temperature
    padding = start + w.shape[0] - vocab_size
    if padding > 0:
        logits[:, max(w.shape[0] - padding, 0) :] = _PADDED_LOGIT
    return logits


def _local_targets(targets: torch.Tensor, start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column in this rank's slice, clamped into it; whether the target lies in the slice)."""
    local = targets - start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), mine


def _all_reduce(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        group: Any,
        temperature: float,
        rows: int,
        with_entropy: bool,
        entropy_grad: bool,
        vocab_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, local_vocab = hidden.shape[0], weight.shape[0]
        start = dist.get_rank(group) * local_vocab
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # log Z = max + log(sum exp(z - max)), kept as its two parts: recombined, float32 would round the
        # sum to ulp(max), an error of ~1e-5 at logits of ~100
        maxima = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_sums = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(hidden.dtype)
        for s in range(0, n, rows):
            z = _local_logits(hidden[s : s + rows], w, temperature, start, vocab_size)
            top = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            shifted = z.sub_(top[:, None])  # z - max: 0 at the max, padding stays ~-1e30
            exp = shifted.exp()
            total = _all_reduce(exp.sum(dim=-1), group)
            log_sum = total.log()
            local, mine = _local_targets(targets[s : s + rows], start, local_vocab)
            picked = shifted.gather(-1, local[:, None]).squeeze(-1) * mine
            logprobs[s : s + rows] = _all_reduce(picked, group) - log_sum
            maxima[s : s + rows] = top
            log_sums[s : s + rows] = log_sum
            if with_entropy:  # H = log Z - sum_v p_v z_v = log sum - sum_v p_v (z_v - max)
                # p (z - max) written over exp: the same products, one [rows, vocab] buffer fewer
                p_z = _all_reduce(exp.mul_(shifted).sum(dim=-1) / total, group)
                entropy[s : s + rows] = log_sum - p_z
            del z, shifted, exp  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, targets, maxima, log_sums, entropy)
        ctx.group, ctx.temperature, ctx.rows, ctx.entropy_grad = group, temperature, rows, entropy_grad
        ctx.vocab_size = vocab_size
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, maxima, log_sums, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        group, temperature, rows = ctx.group, ctx.temperature, ctx.rows  # type: ignore[attr-defined]
        use_entropy = ctx.entropy_grad and grad_entropy is not None  # type: ignore[attr-defined]
        local_vocab = weight.shape[0]
        start = dist.get_rank(group) * local_vocab
        # every rank's share of grad @ W, summed in float32 (bf16 partials cancel)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            sum_dtype = torch.promote_types(hidden.dtype, torch.float32)
            grad_hidden = torch.zeros(hidden.shape, dtype=sum_dtype, device=hidden.device)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.to(hidden.dtype)
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            log_q = _local_logits(h, w, temperature, start, ctx.vocab_size)  # type: ignore[attr-defined]
            log_q.sub_(maxima[s : s + rows, None]).sub_(log_sums[s : s + rows, None])
            q = log_q.exp()
            g = grad_logprobs[s : s + rows]
            local, mine = _local_targets(targets[s : s + rows], start, local_vocab)
            grad = logit_gradient(
                log_q,
                q,
                g,
                local,
                g * mine,  # the target's column is on one rank only
                entropy[s : s + rows] if use_entropy else None,
                grad_entropy[s : s + rows] if use_entropy else None,  # type: ignore[index]
                temperature,
            )
            del log_q
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s : s + rows] = grad @ w
            if grad_weight is not None:
                add_weight_gradient(grad_weight, grad, h)
            del q, grad  # before the next chunk's logits exist
        if grad_hidden is not None:
            grad_hidden = _all_reduce(grad_hidden, group).to(hidden.dtype)
        grad_w = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_w, None, None, None, None, None, None, None
