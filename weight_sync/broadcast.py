"""`broadcast`: buckets broadcast over a process group of the trainer's sending rank and the engines (NCCL on
GPUs, gloo on CPU; group.py), for engines on their own GPUs or machines.

The sender opens the group at connect (it serves the rendezvous store; each engine gets the address in its
Connect) and closes it at close. Each bucket is announced on the control channels (its layout) and then
broadcast from a pool of `buffers` staging buckets on the trainer's device, asynchronously: packing bucket
k+1 overlaps the broadcast of bucket k. Experts travel as the stacked [E, ...] blocks the streams hold them
in (a block larger than a bucket in pieces, written straight into the engine's stacked parameter).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from miles.weight_sync.buckets import BucketLayout
from miles.weight_sync.group import (
    GroupAddress,
    backend_for,
    broadcast,
    close_group,
    host_store,
    join_store,
    open_group,
)
from miles.weight_sync.protocol import Bucket, SyncTimeout
from miles.weight_sync.receiver import WeightReceiver
from miles.weight_sync.sender import WeightSender


def wait(work: Any, device: torch.device, timeout_s: float) -> None:
    """gloo: the host waits, up to the timeout. NCCL: the current stream waits, the host does not (a host
    wait would stall the pipeline; NCCL's watchdog enforces the group's timeout)."""
    if device.type == "cuda":
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


class BroadcastSender(WeightSender):
    transport = "broadcast"

    def __init__(self, *args: Any, host: str = "127.0.0.1", **kwargs: Any) -> None:
        """`host`: the address engines reach this process at (for the group's rendezvous store)."""
        super().__init__(*args, **kwargs)
        self.host = host
        self._store: Any = None
        self._address: GroupAddress | None = None
        self._group: Any = None
        self._staging: list[torch.Tensor] = []
        self._works: dict[int, tuple[int, Any]] = {}
        """Buffer -> (the bucket, the broadcast of it still in flight)."""

    def _connect_options(self, engine: int) -> dict[str, Any]:
        if self._address is None:
            backend = backend_for(self.device)
            self._store, self._address = host_store(
                self.host, 1 + len(self.channels), backend, self.timeout_s
            )
        return {"address": self._address, "rank": engine + 1}

    def _open(self) -> None:
        assert self._address is not None
        self._group = open_group(self._store, self._address, 0)
        self._staging = [
            torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.buffers)
        ]

    def _buffer(self, index: int) -> torch.Tensor:
        return self._staging[index]

    def _reclaim(self, index: int) -> None:
        pending = self._works.pop(index, None)
        if pending is not None:
            self._wait(*pending)

    def _publish(self, layout: BucketLayout) -> None:
        for channel in self.channels:
            channel.send(Bucket(layout))
        work = broadcast(self._group, self._staging[layout.buffer][: layout.nbytes])
        self._works[layout.buffer] = (layout.index, work)

    def _wait(self, bucket: int, work: Any) -> None:
        try:
            wait(work, self.device, self.timeout_s)
        except RuntimeError as err:
            engines = ", ".join(f"{c.peer} (group rank {i + 1})" for i, c in enumerate(self.channels))
            raise SyncTimeout(
                f"the broadcast of bucket {bucket} did not complete within {self.timeout_s:g} s: one of {engines} "
                f"stopped taking part ({err}); raise weight_sync.timeout_s if they are only slow"
            ) from err

    def _release(self) -> None:
        for index in list(self._works):
            try:
                self._reclaim(index)
            except SyncTimeout:
                pass
        if self._group is not None:
            close_group(self._group)
        self._group, self._store, self._address, self._staging = None, None, None, []


class BroadcastReceiver(WeightReceiver):
    def __init__(self, options: dict[str, Any], device: torch.device, timeout_s: float) -> None:
        super().__init__(options, device, timeout_s)
        self.address: GroupAddress = options["address"]
        self.rank = int(options["rank"])
        self._store = join_store(self.address)
        self._group = open_group(self._store, self.address, self.rank)
        self._buffers: dict[int, torch.Tensor] = {}

    def acquire(self, layout: BucketLayout) -> torch.Tensor:
        buffer = self._buffers.get(layout.buffer)
        if buffer is None or buffer.numel() < layout.nbytes:
            # As large as the biggest bucket seen: the sender's bucket size after the first full one.
            buffer = self._buffers[layout.buffer] = torch.empty(
                layout.nbytes, dtype=torch.uint8, device=self.device
            )
        try:
            wait(broadcast(self._group, buffer[: layout.nbytes]), self.device, self.timeout_s)
        except RuntimeError as err:
            raise SyncTimeout(
                f"the trainer (group rank 0) did not broadcast bucket {layout.index} within {self.timeout_s:g} s "
                f"({err})"
            ) from err
        return buffer

    def close(self) -> None:
        close_group(self._group)
        self._group = self._store = None
        self._buffers = {}
