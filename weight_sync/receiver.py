"""The engine side of one transport: `WeightReceiver` says where a bucket's bytes are and when its buffer is
free (the sync protocol around it is `target.EngineSyncTarget`'s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from miles.weight_sync.buckets import BucketLayout


class WeightReceiver(ABC):
    """What a transport does on the engine side: where a bucket's bytes are, and when its buffer is free."""

    def __init__(self, options: dict[str, Any], device: torch.device, timeout_s: float) -> None:
        self.options, self.device, self.timeout_s = options, device, timeout_s

    def answer(self) -> dict[str, Any]:
        """`Connected.options` for the sender."""
        return {}

    @abstractmethod
    def acquire(self, layout: BucketLayout) -> torch.Tensor:
        """The flat uint8 buffer holding the bucket, readable in order on the current (CUDA) stream."""

    def release(self, layout: BucketLayout) -> None:  # noqa: B027 (an optional hook)
        """Every copy out of the bucket's buffer has been issued: the sender may refill it after the Ack."""

    def wait_shared(self) -> None:  # noqa: B027 (an optional hook)
        """Direct: before the engine copies from the trainer's tensors, wait (on the current stream) for the
        trainer's writes to them (cuda_ipc: its ready event; shm: nothing, the trainer's host is done)."""

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Drop the transport's handles (buffers, events, group)."""
