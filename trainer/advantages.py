"""Built-in advantage estimators: one scalar advantage per sample from the rewards of its batch.

Each has the plugin signature `fn(samples: list[Sample], cfg: AlgorithmConfig) -> list[float]`.
Groups are the `n` responses to one prompt (`Sample.group_id`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from miles.config import AlgorithmConfig
from miles.sample import Sample
from miles.trainer.registry import register_advantage

STD_EPS = 1e-6
"""Added to the group std before dividing, so a group with tiny spread does not explode."""


def group_indices(samples: list[Sample]) -> list[list[int]]:
    """Sample positions of each group, in order of first appearance."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        groups[sample.group_id].append(i)
    return list(groups.values())


def rewards_tensor(samples: list[Sample]) -> torch.Tensor:
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
    if not torch.isfinite(rewards).all():
        bad = [i for i, ok in enumerate(torch.isfinite(rewards).tolist()) if not ok]
        raise ValueError(
            f"non-finite rewards at sample positions {bad[:8]}; the reward runner must score them 0"
        )
    return rewards


def _centre(rewards: torch.Tensor) -> torch.Tensor:
    """rewards - their mean; exactly 0 when all rewards are equal. The float mean of equal rewards can be off
    by an ulp (7 x 0.7 averages to 0.7 + 1.1e-16), which the std division turns into a same-signed ~1e-10
    advantage on every sample of a group that carries no signal (AdamW then scales it up)."""
    if rewards.numel() > 0 and bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def _group_centred(samples: list[Sample], normalize_std: bool) -> list[float]:
    rewards = rewards_tensor(samples)
    advantages = torch.zeros_like(rewards)
    for idx in group_indices(samples):
        if len(idx) < 2:  # no baseline from a group of one: it carries no learning signal
            continue
        group = rewards[idx]
        centred = _centre(group)
        if normalize_std:
            centred = centred / (group.std(unbiased=True) + STD_EPS)
        advantages[idx] = centred
    return advantages.tolist()


@register_advantage("grpo")
def grpo(samples: list[Sample], cfg: AlgorithmConfig) -> list[float]:
    """(r - mean_group) / (std_group + eps); without the division when `cfg.normalize_std` is false."""
    return _group_centred(samples, normalize_std=cfg.normalize_std)


@register_advantage("dr_grpo")
def dr_grpo(samples: list[Sample], cfg: AlgorithmConfig) -> list[float]:
    """Dr. GRPO: r - mean_group, never divided by the std (whatever `normalize_std` says)."""
    return _group_centred(samples, normalize_std=False)


@register_advantage("rloo")
def rloo(samples: list[Sample], cfg: AlgorithmConfig) -> list[float]:
    """REINFORCE leave-one-out: r_i - mean of the other rewards of its group = n/(n-1) (r_i - mean_group)."""
    rewards = rewards_tensor(samples)
    advantages = torch.zeros_like(rewards)
    for idx in group_indices(samples):
        n = len(idx)
        if n < 2:
            continue
        group = rewards[idx]
        advantages[idx] = _centre(group) * n / (n - 1)
    return advantages.tolist()


@register_advantage("reinforce")
def reinforce(samples: list[Sample], cfg: AlgorithmConfig) -> list[float]:
    """REINFORCE with the batch-mean baseline: r - mean over the whole batch (groups ignored)."""
    rewards = rewards_tensor(samples)
    return _centre(rewards).tolist()
