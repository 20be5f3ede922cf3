"""Built-in policy losses (per token) and the aggregation that turns them into one scalar.

A policy loss has the plugin signature `fn(batch: PolicyLossInput, cfg: AlgorithmConfig) -> PolicyLossOutput`
and returns one loss value per response token; the trainer multiplies it by `token_weights` (the chosen
aggregation, normalised over the whole optimizer batch) and sums, so gradient accumulation over packed
micro-batches equals one big batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from miles.config import AlgorithmConfig
from miles.trainer.registry import register_policy_loss

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")

LOG_RATIO_CLAMP = 20.0
"""Importance ratios are exp(log-ratio); clamping keeps a diverged step finite (it is clipped anyway)."""


@dataclass
class PolicyLossInput:
    """Per-token tensors [M] over the response tokens of one packed micro-batch."""

    logprobs: torch.Tensor
    """Current policy logprobs (with grad)."""
    old_logprobs: torch.Tensor
    """Logprobs recomputed by the trainer before the update (no grad): the PPO behaviour policy."""
    advantages: torch.Tensor
    """The sample's advantage broadcast to its tokens."""
    loss_mask: torch.Tensor
    """1.0 for tokens that count, 0.0 otherwise (float)."""
    seq_index: torch.Tensor
    """Sequence of each token within the micro-batch (0..num_seqs-1)."""
    num_seqs: int
    tis_weights: torch.Tensor | None = None
    """Truncated importance weights min(pi_old / pi_rollout, cap), detached; None when TIS is off."""


@dataclass
class PolicyLossOutput:
    token_loss: torch.Tensor
    """[M] loss per token, before aggregation (masking happens in the aggregation weights)."""
    token_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """[M] per-token values that the trainer averages over loss tokens and logs under these names."""


@dataclass
class LossNormalizer:
    """Denominators of the aggregation over one whole optimizer batch (all of its micro-batches)."""

    mode: str
    num_tokens: int
    """Loss tokens (loss-mask sum) in the optimizer batch."""
    num_seqs: int
    """Sequences with at least one loss token in the optimizer batch."""

    def __post_init__(self) -> None:
        if self.mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg {self.mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")

    @classmethod
    def from_masks(cls, mode: str, masks: list[torch.Tensor]) -> LossNormalizer:
        """The denominators of `masks` (one per sequence), read with one host sync: a `.item()` per mask
        cost a small model's update a device round trip per sample."""
        if not masks:
            return cls(mode=mode, num_tokens=0, num_seqs=0)
        # Per-mask sums as differences of one float64 running sum: exact for 0/1 masks.
        flat = torch.cat([m.reshape(-1) for m in masks]).double()
        running = torch.cat([flat.new_zeros(1), flat.cumsum(0)])
        ends = torch.tensor(list(itertools.accumulate(m.numel() for m in masks)), device=flat.device)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        sums = [int(s) for s in (running[ends] - running[starts]).tolist()]
        return cls(mode=mode, num_tokens=sum(sums), num_seqs=sum(1 for s in sums if s > 0))

    def token_weights(self, loss_mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """[M] weights w such that sum(w * per_token_values) is this micro-batch's share of the batch loss.

        token_mean:          sum_t l_t / T_batch
        seq_mean_token_mean: sum_i (sum_t l_it / T_i) / S_batch
        seq_mean_token_sum:  sum_i (sum_t l_it) / S_batch
        """
        mask = loss_mask.float()
        if self.num_tokens == 0:
            return torch.zeros_like(mask)
        if self.mode == "token_mean":
            return mask / self.num_tokens
        if self.mode == "seq_mean_token_sum":
            return mask / self.num_seqs
        seq_tokens = torch.zeros(num_seqs, dtype=mask.dtype, device=mask.device).index_add_(
            0, seq_index, mask
        )
        return mask / seq_tokens.clamp(min=1.0)[seq_index] / self.num_seqs


def _apply_tis(token_loss: torch.Tensor, batch: PolicyLossInput) -> torch.Tensor:
    return token_loss if batch.tis_weights is None else token_loss * batch.tis_weights


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic loss max(-A r, -A clip(r, 1-clip_low, 1+clip_high)) and where the clip is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@register_policy_loss("ppo_clip")
def ppo_clip(batch: PolicyLossInput, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """Token-level PPO clip with separate lower/upper epsilons (DAPO's clip-higher when clip_high > clip_low)."""
    log_ratio = (batch.logprobs - batch.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss, is_clipped = clipped_surrogate(ratio, batch.advantages, cfg.clip_low, cfg.clip_high)
    return PolicyLossOutput(
        token_loss=_apply_tis(loss, batch),
        token_metrics={"train/clipfrac": is_clipped, "train/ratio_mean": ratio.detach()},
    )


@register_policy_loss("gspo")
def gspo(batch: PolicyLossInput, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """GSPO (token form): the ratio is the sequence's length-normalised likelihood ratio
    s_i = exp(mean_t log(pi/pi_old)), applied to every token as sg[s_i] * pi_t / sg[pi_t], then clipped.

    With `loss_agg=seq_mean_token_mean` and one advantage per sequence its gradient equals sequence-level GSPO.
    GSPO's clip range is small (the paper uses clip_low=3e-4, clip_high=4e-4).
    """
    mask = batch.loss_mask.to(batch.logprobs.dtype)
    token_log_ratio = (batch.logprobs - batch.old_logprobs) * mask
    zeros = torch.zeros(batch.num_seqs, dtype=token_log_ratio.dtype, device=token_log_ratio.device)
    seq_sum = zeros.index_add(0, batch.seq_index, token_log_ratio)
    seq_len = zeros.index_add(0, batch.seq_index, mask).clamp(min=1.0)
    seq_log_ratio = (seq_sum / seq_len).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = seq_log_ratio.detach()[batch.seq_index] + batch.logprobs - batch.logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss, is_clipped = clipped_surrogate(ratio, batch.advantages, cfg.clip_low, cfg.clip_high)
    return PolicyLossOutput(
        token_loss=_apply_tis(loss, batch),
        token_metrics={"train/clipfrac": is_clipped, "train/ratio_mean": ratio.detach()},
    )


@register_policy_loss("sft")
def sft(batch: PolicyLossInput, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """Supervised fine-tuning: negative log-likelihood of the response tokens (advantages are ignored)."""
    return PolicyLossOutput(token_loss=-batch.logprobs)
