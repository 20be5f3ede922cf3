"""How far the trainer's logprobs are from the engine's: the `mismatch/*` metrics and the truncated importance
sampling (TIS) weights that correct for it, over a batch's concatenated tokens (one host sync a batch; a sync
per sample cost a small model's update ~1,000 of them)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from miles.distributed import SINGLE, DataParallel
from miles.trainer.kl import kl_estimate


def rows_on_device(rows: list[list[float]], device: torch.device) -> list[torch.Tensor]:
    """Per-sample float32 rows on `device` through one host-to-device copy (a copy per row costs a small
    model's update hundreds of transfers)."""
    sizes = [len(row) for row in rows]
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.float32, sum(sizes))
    return list(torch.split(torch.from_numpy(flat).to(device), sizes))


def mismatch_metrics(
    old: list[torch.Tensor],
    rollout: list[torch.Tensor | None],
    masks: list[torch.Tensor],
    dp: DataParallel = SINGLE,
) -> dict[str, float]:
    """Trainer-vs-engine agreement over the loss tokens of samples that carry rollout logprobs (of every
    rank's samples). Computed on the concatenated tokens with masked sums: one host sync for the batch."""
    pairs = [(o, r, m) for o, r, m in zip(old, rollout, masks) if r is not None]
    stats = torch.zeros(4, dtype=torch.float64)  # kept tokens, sum |diff|, sum kl, max |diff|
    if pairs and any(o.numel() for o, _, _ in pairs):
        trainer_lp = torch.cat([o for o, _, _ in pairs])
        rollout_lp = torch.cat([r for _, r, _ in pairs])
        keep = torch.cat([m for _, _, m in pairs]) > 0
        diff = torch.where(keep, (trainer_lp - rollout_lp).abs(), 0.0)
        # The engine sampled these tokens, so k3 with r = pi_trainer / pi_rollout is unbiased for KL(rollout || trainer).
        kl = torch.where(keep, kl_estimate(rollout_lp, trainer_lp, "k3"), 0.0)
        stats = torch.stack(
            [keep.sum().double(), diff.double().sum(), kl.double().sum(), diff.max().double()]
        ).cpu()
    count, diff_sum, kl_sum, diff_max = stats.tolist()
    if dp.enabled:
        count, diff_sum, kl_sum = dp.all_reduce_floats([count, diff_sum, kl_sum])
        diff_max = dp.all_reduce_floats([diff_max], "max")[0]
    if count == 0:
        return {}
    return {
        "mismatch/logprob_abs_diff_mean": diff_sum / count,
        "mismatch/logprob_abs_diff_max": diff_max,
        "mismatch/kl": kl_sum / count,
    }


def tis_weights(
    old: list[torch.Tensor],
    rollout: list[torch.Tensor | None],
    masks: list[torch.Tensor],
    cap: float,
    dp: DataParallel = SINGLE,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per-token min(pi_old / pi_rollout, cap) (ones where the engine gave no logprobs) and their stats,
    computed on the concatenated tokens (one host sync for the batch) and split back per sample."""
    weights: list[torch.Tensor] = []
    count, clipped, weight_sum = 0.0, 0.0, 0.0
    if old:  # (a data-parallel rank without samples still joins the reduction)
        old_all = torch.cat(old)
        has_rollout = [r is not None for r in rollout]
        rollout_all = torch.cat([r if r is not None else o for o, r in zip(old, rollout)])
        raw = torch.exp(old_all - rollout_all)  # 1 where the sample has no rollout logprobs
        weights_all = raw.clamp(max=cap)
        lengths = [o.numel() for o in old]
        counted = torch.cat(masks) > 0
        if not all(has_rollout):
            with_rollout = _rows_with(has_rollout, lengths, old_all.device)
            weights_all = torch.where(with_rollout, weights_all, 1.0)
            counted &= with_rollout
        weights = list(torch.split(weights_all, lengths))
        stats = [
            counted.sum(),
            ((raw > cap) & counted).sum(),
            torch.where(counted, weights_all, 0.0).double().sum(),
        ]
        count, clipped, weight_sum = torch.stack([x.double() for x in stats]).cpu().tolist()
    if dp.enabled:
        count, clipped, weight_sum = dp.all_reduce_floats([count, clipped, weight_sum])
    if count == 0:
        return weights, {}
    return weights, {
        "mismatch/tis_clipfrac": clipped / count,
        "mismatch/tis_weight_mean": weight_sum / count,
    }


def _rows_with(flags: list[bool], lengths: list[int], device: torch.device) -> torch.Tensor:
    """A token mask: True on the tokens of the samples whose flag is set."""
    return torch.repeat_interleave(
        torch.tensor(flags, device=device), torch.tensor(lengths, device=device), output_size=sum(lengths)
    )
