"""Which class sends and which receives for each `weight_sync.transport` (`inprocess` has neither: it is
`InProcessWeightSync`, one process holding both sides)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles.weight_sync.broadcast import BroadcastReceiver, BroadcastSender
from miles.weight_sync.channel import Channel
from miles.weight_sync.direct_sender import DirectSender
from miles.weight_sync.protocol import TRANSPORTS, Connect
from miles.weight_sync.receiver import WeightReceiver
from miles.weight_sync.sender import WeightSender
from miles.weight_sync.shared_buffers import CudaIpcReceiver, CudaIpcSender, ShmReceiver, ShmSender

SENDERS: dict[str, type[WeightSender]] = {
    "cuda_ipc": CudaIpcSender,
    "shm": ShmSender,
    "broadcast": BroadcastSender,
}
RECEIVERS: dict[str, type[WeightReceiver]] = {
    "cuda_ipc": CudaIpcReceiver,
    "shm": ShmReceiver,
    "broadcast": BroadcastReceiver,
}


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight_sync.transport={transport!r}; use one of {', '.join(TRANSPORTS)}")


def make_sender(
    transport: str,
    channels: Sequence[Channel],
    bucket_mb: float = 512,
    timeout_s: float = 300.0,
    device: str | torch.device = "cpu",
    direct: bool = True,
    **options: Any,
) -> WeightSender:
    """The trainer side of `transport` to the engines behind `channels` (not connected yet: call
    `connect()`). `direct`: shm and cuda_ipc sync persistent parameters straight from the trainer's storages,
    with no bucket pool (False: always buckets; broadcast has buckets only). `options`: the transport's own
    (`buffers`; broadcast's `host`)."""
    check_transport(transport)
    if transport == "inprocess":
        raise ValueError(
            "weight_sync.transport=inprocess has no sender: the engine runs in the trainer's process; use "
            "InProcessWeightSync(policy, engine)"
        )
    bucket_bytes = int(bucket_mb * 1024**2)
    sender = SENDERS[transport]
    if issubclass(sender, DirectSender):
        options["direct"] = direct
    return sender(channels, bucket_bytes, timeout_s, device=device, **options)


def make_receiver(message: Connect, device: torch.device, timeout_s: float) -> WeightReceiver:
    """The engine side of the transport a `Connect` asks for."""
    if message.transport not in RECEIVERS:
        raise ValueError(f"no receiver for weight_sync.transport={message.transport!r}")
    return RECEIVERS[message.transport](message.options, device, timeout_s)
