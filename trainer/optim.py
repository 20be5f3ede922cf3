"""AdamW construction and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch

from miles.config import OptimConfig, TrainerConfig

SCHEDULES = ("constant", "cosine")


def build_optimizer(params: list[torch.Tensor], cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW at peak LR `cfg.lr` over the trainable tensors `params` (the model's parameters, or their float32
    master copies); norms and biases (1-D tensors) are exempt from weight decay, as usual."""
    optim = cfg.optim
    if len(optim.betas) != 2:
        raise ValueError(f"trainer.optim.betas needs two values, got {list(optim.betas)}")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    groups = [
        {"params": group, "weight_decay": wd}
        for group, wd in ((decay, optim.weight_decay), (no_decay, 0.0))
        if group
    ]
    # The fused kernel updates all CUDA parameters in a few launches (2.4x faster than foreach on an H200 for
    # Qwen3-1.7B's float32 weights); it needs every parameter on CUDA and floating point.
    ordered = decay + no_decay
    fused = all(p.is_cuda and p.is_floating_point() for p in ordered)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        eps=optim.eps,
        fused=fused or None,
    )


def lr_multiplier(step: int, optim: OptimConfig, total_steps: int | None) -> float:
    """Factor of the peak LR used by optimizer step `step` (0-based).

    Warm-up: (step + 1) / warmup_steps, so the first update already moves. Cosine: from 1 right after
    warm-up down to `min_lr_ratio` at the last step (`total_steps - 1`), then flat.
    """
    if optim.schedule not in SCHEDULES:
        raise ValueError(
            f"unknown trainer.optim.schedule {optim.schedule!r}; use one of {', '.join(SCHEDULES)}"
        )
    warmup = optim.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if optim.schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError("the cosine schedule needs the total number of optimizer steps")
    decay_steps = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
