"""The hand-written backward of the logprob and entropy of a chunk of logits, shared by the chunked
(one-process) and the vocabulary-parallel logprobs."""

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
