"""A process group of the trainer's sending rank (rank 0) and the engines (ranks 1..N), apart from any group
the trainer's ranks already form: built from its own TCP store and the backend's class directly, so it
neither needs nor touches torch.distributed's default group (the trainer's data/tensor-parallel one).

NCCL on GPUs (one GPU per rank: NCCL refuses two ranks on one device; colocated engines use cuda_ipc), gloo
on CPU. Its collectives time out after `timeout_s`; with NCCL, torch's watchdog may then end the process.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupAddress:
    """Everything a rank needs to join: picklable, sent to each engine in its `Connect.options`."""

    host: str
    port: int
    world_size: int
    prefix: str
    backend: str
    timeout_s: float


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(
    host: str, world_size: int, backend: str, timeout_s: float
) -> tuple[dist.TCPStore, GroupAddress]:
    """The rendezvous store, served by the sending rank on a free port, and the group's address."""
    store = dist.TCPStore(
        host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    prefix = f"miles-weight-sync-{uuid.uuid4().hex[:12]}"
    return store, GroupAddress(host, store.port, world_size, prefix, backend, timeout_s)


def join_store(address: GroupAddress) -> dist.TCPStore:
    return dist.TCPStore(
        address.host, address.port, address.world_size, False, timeout=timedelta(seconds=address.timeout_s)
    )


def open_group(store: dist.Store, address: GroupAddress, rank: int) -> Any:
    """This rank's backend object of the group (blocks until every rank joined, up to the timeout)."""
    prefixed = dist.PrefixStore(address.prefix, store)
    timeout = timedelta(seconds=address.timeout_s)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
    if address.backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("the broadcast weight sync over GPUs needs NCCL, which this torch lacks")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    raise ValueError(f"unknown process-group backend {address.backend!r}; use nccl or gloo")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast of `tensor` from rank 0; returns its work (wait on it)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def close_group(group: Any) -> None:
    """Tear the group down (NCCL frees its communicator; a gloo group closes with its last reference)."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except RuntimeError:  # already aborted after an error
            pass
