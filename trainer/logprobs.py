"""Per-token logprobs (and entropy) of the response tokens of a packed micro-batch.

Logits are computed only at the rows that predict response tokens (prompt rows never reach the LM head),
outside autocast and in float32, so a bf16 trainer still measures logprobs at full precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models import CausalLM, RoutingTrace, VarlenAttention
from miles.trainer.packing import MicroBatch

PRECISIONS = ("fp32", "bf16")


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
) -> TokenLogprobs:
    """Forward one micro-batch and return logprobs of its response tokens (grad follows the caller's mode)."""
    if temperature <= 0:
        raise ValueError(f"logprobs need a positive temperature, got {temperature}")
    routing = (
        RoutingTrace(record=False, replay=batch.routing_replay) if batch.routing_replay is not None else None
    )
    with autocast(batch.input_ids.device, precision):
        out = model.forward_packed(
            batch.input_ids, batch.positions, VarlenAttention(batch.cu_seqlens), routing
        )
    hidden = out.hidden[batch.target_rows].to(model.dtype)
    logits = model.compute_logits(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    token_logprobs = log_probs.gather(-1, batch.targets[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = log_probs if entropy_grad else log_probs.detach()
            entropy = -(source.exp() * source).sum(-1)
    return TokenLogprobs(logprobs=token_logprobs, entropy=entropy)
