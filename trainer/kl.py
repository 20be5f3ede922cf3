"""Per-token estimators of KL(p || q) from samples drawn from p (Schulman, "Approximating KL divergence").

With log r = log q(x) - log p(x) for a token x ~ p:
  k1 = -log r                 unbiased, high variance, can be negative
  k2 = (log r)^2 / 2          biased (exact to second order), always >= 0
  k3 = (r - 1) - log r        unbiased, always >= 0, low variance
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")

LOG_RATIO_CLAMP = 20.0
"""k3 exponentiates the log-ratio; clamping keeps a diverged policy from producing inf (|log r| > 20 is
already a broken run)."""


def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(p || q) given log p and log q of tokens sampled from p."""
    log_ratio = logq - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")
