"""`rollout.release_weights_during_train`, checked at start: only an embedded engine with weights of its own,
on a CUDA driver with virtual memory management, can give them back during the update (rollout/weights_region.py).
"""

from __future__ import annotations

from miles.config.schema import MilesConfig
from miles.errors import MilesUserError

KEY = "rollout.release_weights_during_train"


def check_weights_release(config: MilesConfig) -> None:
    """Refuse the option where the engine has no copy of its own to release, or cannot keep its addresses."""
    if not config.rollout.release_weights_during_train:
        return
    placement, trainer = config.placement, config.trainer
    if placement.mode == "ray":
        raise MilesUserError(
            f"{KEY} releases the embedded engine's weights inside the trainer's process; the Ray placement's "
            f"engines are actors of their own: set {KEY}=false (or use placement.mode=embedded)"
        )
    if placement.engine_process:
        raise MilesUserError(
            f"{KEY} releases the embedded engine's weights inside the trainer's process; with "
            f"placement.engine_process=true the engine runs in another process: set {KEY}=false (or "
            "placement.engine_process=false)"
        )
    if trainer.backend == "torch":
        raise MilesUserError(
            f"{KEY}: with trainer.backend=torch the engine runs the trainer's own module (with or without "
            "trainer.distributed_optimizer), whose weights the update changes, so there is no copy to release; "
            f"use trainer.backend=megatron or deepspeed, or set {KEY}=false"
        )
    if config.rollout.spec_draft_train and config.rollout.speculative == "head":
        raise MilesUserError(
            f"{KEY}: the draft head trains on the engine model's hidden states during the update, while its "
            f"weights are released: set rollout.spec_draft_train=false or {KEY}=false"
        )
    check_device(config.model.device)


def check_device(device_name: str) -> None:
    """The model's device is CUDA, and its driver reserves addresses and maps memory behind them."""
    from miles.model_io import pick_device
    from miles.rollout.kv import virtual_memory

    device = pick_device(device_name)
    if device.type != "cuda":
        raise MilesUserError(
            f"{KEY} frees GPU memory for the update; the model runs on {device} (model.device={device_name}): "
            f"set {KEY}=false"
        )
    if not virtual_memory.supported(device):
        raise MilesUserError(
            f"{KEY} keeps the weights at reserved CUDA virtual addresses, which the driver of {device} does "
            f"not support (no virtual memory management): set {KEY}=false"
        )
