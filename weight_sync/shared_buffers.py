"""Transports through memory both processes map: `shm` (CPU shared memory) and `cuda_ipc` (CUDA IPC).

Direct mode (the default, direct_sender.py): the engines map the trainer's own parameters and copy straight
from them; no bucket pool is allocated. shm moves each parameter's storage into shared memory in place (the
optimizer's in-place updates keep it there); cuda_ipc shares the parameters' CUDA allocations as they are,
plus one "ready" event the trainer records before each sync and the engine's stream waits on.

Buckets (`direct=False`, or a stream that must be converted: the megatron backend's): the sender allocates a
pool of `buffers` flat buckets of `bucket_bytes` ONCE (at connect; in direct mode at the first bucketed
sync, reconnecting) and sends their handles to each engine once; the engine maps them once and reads every
later bucket from them. The pool is KEPT for the sender's whole life, between and around updates (closing
the sender frees it): opening fresh IPC handles for a 512 MiB bucket costs several times the device copy of
it, so a pool re-opened every step would cost more than the transfer. It costs `buffers * bucket_bytes` of
the trainer's memory (its GPU's, for cuda_ipc; the engine maps it without allocating); size
weight_sync.bucket_mb with that in mind.

`shm` synchronises by the control channel alone: the engine's copies out of a bucket are done (CPU copies
are synchronous) when it acknowledges it. `cuda_ipc` adds two CUDA events per buffer, shared between the
processes once at connect: the sender records "filled" after packing, the engine's stream waits on it before
copying out and records "consumed" after; the engine acknowledges once "consumed" is recorded (not
finished), and the sender's stream waits on it before packing that buffer again. Neither host ever waits for
the device per tensor or per bucket: packing bucket k+1 overlaps the engine's copy of bucket k.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from miles.weight_sync.buckets import BucketLayout
from miles.weight_sync.direct_sender import DirectSender
from miles.weight_sync.protocol import Bucket, Connected, SyncError
from miles.weight_sync.receiver import WeightReceiver

log = logging.getLogger(__name__)


class ShmSender(DirectSender):
    """Direct from CPU parameters moved into shared memory; else packs into CPU shared-memory buckets
    (trainer tensors on a GPU are copied to them)."""

    transport = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: list[torch.Tensor] = []

    def share_device(self) -> torch.device:
        return torch.device("cpu")

    def takes_direct(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        if not super().takes_direct(named):
            return False
        pending = sum(t.untyped_storage().nbytes() for _, t in named if t.numel() and not t.is_shared())
        free = shm_free_bytes()
        if pending and free is not None and pending > free:
            # A write past what /dev/shm holds is a SIGBUS, not an error: the buckets need far less.
            log.warning(
                "weight sync: the trainer's %d MiB of parameters do not fit in /dev/shm (%d MiB free); syncing "
                "through shm buckets instead (enlarge /dev/shm, e.g. docker --shm-size, to sync direct)",
                pending >> 20,
                free >> 20,
            )
            return False
        return True

    def _prepare_share(self, tensor: torch.Tensor) -> None:
        if tensor.numel():  # in place: the parameter keeps its storage object, now in shared memory
            tensor.share_memory_()

    def _connect_options(self, engine: int) -> dict[str, Any]:
        if self.pooled and not self._pool:
            self._pool = [
                torch.empty(self.bucket_bytes, dtype=torch.uint8).share_memory_() for _ in range(self.buffers)
            ]
        return {"buffers": self._pool}

    def _buffer(self, index: int) -> torch.Tensor:
        return self._pool[index]

    def _publish(self, layout: BucketLayout) -> None:
        for channel in self.channels:
            channel.send(Bucket(layout))

    def _release(self) -> None:
        super()._release()
        self._pool = []


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, where torch's shared CPU storages live on Linux (None: no such folder)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


class ShmReceiver(WeightReceiver):
    def __init__(self, options: dict[str, Any], device: torch.device, timeout_s: float) -> None:
        super().__init__(options, device, timeout_s)
        self._pool: list[torch.Tensor] = list(options["buffers"])

    def acquire(self, layout: BucketLayout) -> torch.Tensor:
        return self._pool[layout.buffer]

    def close(self) -> None:
        self._pool = []


class CudaIpcSender(DirectSender):
    """Direct from the trainer's CUDA parameters, which colocated engines map by IPC handle; else packs into
    a pool of CUDA buckets on the trainer's GPU that they map."""

    transport = "cuda_ipc"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(
                f"cuda_ipc packs on a GPU, not {self.device}; use weight_sync.transport=shm on CPU"
            )
        self._pool: list[torch.Tensor] = []
        self._filled: list[torch.cuda.Event] = []
        self._consumed: list[list[torch.cuda.Event]] = []
        """Per engine, per buffer: the event its stream records once it has copied the buffer out."""
        self._ready: torch.cuda.Event | None = None
        """Direct: recorded on the trainer's stream before each Load; the engines' streams wait on it."""

    def share_device(self) -> torch.device:
        # The GPU whose stream records the ready event (the optimizer step that wrote the tensors ran there).
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)

    def _mark_ready(self) -> None:
        assert self._ready is not None, "the ready event is created at connect"
        self._ready.record(torch.cuda.current_stream(self.device))

    def _connect_options(self, engine: int) -> dict[str, Any]:
        with torch.cuda.device(self.device):
            if self.pooled and not self._pool:
                self._pool = [
                    torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
                    for _ in range(self.buffers)
                ]
                self._filled = [torch.cuda.Event(interprocess=True) for _ in range(self.buffers)]
                for event in self._filled:  # created on this device now, not lazily on another one
                    event.record(torch.cuda.current_stream(self.device))
            if self.direct and self._ready is None:
                self._ready = torch.cuda.Event(interprocess=True)
                self._ready.record(torch.cuda.current_stream(self.device))
        return {"buffers": self._pool, "filled": self._filled, "ready": self._ready}

    def _opened(self, engines: list[Connected]) -> None:
        self._consumed = [list(e.options["consumed"]) for e in engines]

    def _buffer(self, index: int) -> torch.Tensor:
        return self._pool[index]

    def _reclaim(self, index: int) -> None:
        # The engines' Acks say these were recorded after their copies out of the buffer (in this sync or the
        # last): the packing stream waits for the copies, the host does not.
        stream = torch.cuda.current_stream(self.device)
        for events in self._consumed:
            stream.wait_event(events[index])

    def _publish(self, layout: BucketLayout) -> None:
        self._filled[layout.buffer].record(torch.cuda.current_stream(self.device))
        for channel in self.channels:
            channel.send(Bucket(layout))

    def _release(self) -> None:
        super()._release()
        if self._pool or self._ready is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.ipc_collect()  # tensors shared before and freed since: their memory goes back
        self._pool, self._filled, self._consumed, self._ready = [], [], [], None


class CudaIpcReceiver(WeightReceiver):
    def __init__(self, options: dict[str, Any], device: torch.device, timeout_s: float) -> None:
        super().__init__(options, device, timeout_s)
        if device.type != "cuda":
            raise ValueError(
                f"cuda_ipc needs the engine on a GPU, not {device}; use weight_sync.transport=shm"
            )
        self._pool: list[torch.Tensor] = list(options["buffers"])  # mapped here once, by their IPC handles
        self._filled: list[torch.cuda.Event] = list(options["filled"])
        self._ready: torch.cuda.Event | None = options.get("ready")
        with torch.cuda.device(device):
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in self._pool]
            for event in self._consumed:
                event.record(torch.cuda.current_stream(device))

    def answer(self) -> dict[str, Any]:
        return {"consumed": self._consumed}

    def acquire(self, layout: BucketLayout) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self._filled[layout.buffer])
        return self._pool[layout.buffer]

    def release(self, layout: BucketLayout) -> None:
        self._consumed[layout.buffer].record(torch.cuda.current_stream(self.device))

    def wait_shared(self) -> None:
        if self._ready is None:
            raise SyncError("a direct sync over cuda_ipc, but the trainer sent no ready event at connect")
        torch.cuda.current_stream(self.device).wait_event(self._ready)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._pool, self._filled, self._consumed, self._ready = [], [], [], None
        torch.cuda.ipc_collect()
