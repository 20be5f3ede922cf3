"""The hand-written backward of the logprob and entropy of a chunk of logits, and the LM head's weight
gradient summed over the chunks, shared by the chunked (one-process) and the vocabulary-parallel logprobs."""

from __future__ import annotations

import torch


def logit_gradient(
    log_q: torch.Tensor,
    q: torch.Tensor,
    grad_logprobs: torch.Tensor,
    targets: torch.Tensor,
    target_grad: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient of `sum(g * log q[t]) + sum(g_H * H)` with respect to one chunk's logits, computed in
    place on `log_q` and `q` ([rows, columns] float32): `d log q[t] / d z = onehot(t) - q` and
    `d H / d z = -q * (log q + H)`, divided by the temperature. `target_grad` is what each row's target
    column gets (`grad_logprobs`, or 0 where the target lies in another rank's columns)."""
    entropy_term = None
    if grad_entropy is not None and entropy is not None:
        entropy_term = log_q.add_(entropy[:, None]).mul_(q).mul_(grad_entropy[:, None])
    grad = q.mul_(-grad_logprobs[:, None])
    grad.scatter_add_(-1, targets[:, None], target_grad[:, None])
    if entropy_term is not None:
        grad -= entropy_term
    if temperature != 1.0:
        grad /= temperature
    return grad


def add_weight_gradient(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """`grad_weight += grad_logits.T @ hidden` for one chunk, into the float32 [vocab, hidden] sum.

    On CUDA with bf16 operands one GEMM adds its float32 result into the sum (cuBLAS's beta = 1): no bf16
    [vocab, hidden] product, float32 copy and add per chunk, which took ~0.44 s of a 4.3 s 30B-A3B update
    (docs/benchmarks.md), and one rounding fewer."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
    elif grad_logits.is_cuda and grad_weight.dtype == torch.float32:
        torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
    else:  # CPU has no mixed-dtype GEMM
        grad_weight += (grad_logits.t() @ hidden).float()
