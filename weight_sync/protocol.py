"""The messages a trainer (sender) and an engine (receiver) exchange over their control channel, and errors.

A connection, then any number of syncs, then a disconnect:

    trainer                                   engine
    Connect(transport, options)        ->
                                       <-     Connected(dtype, device, version, options)
    Begin(version)                     ->
                                       <-     Ready | Failed (a version going backwards is refused)
    Bucket(layout) x N                 ->     (the bytes go through the transport's buffers or group)
                                       <-     Ack(index) x N  (buffer free again; at most `buffers` behind)
    End(fingerprints, bytes)           ->
                                       <-     Report(checksum_ok, mismatched, ...)
    (or, after a failure on either side)
    Abort(reason)                      ->
                                       <-     Aborted  (the engine's weights are then a mix: sync again)
    Disconnect                         ->
                                       <-     Disconnected

A direct sync (shm, cuda_ipc; direct_sender.py) has no buckets: the engine copies straight out of the
trainer's own parameters, whose storages it opened once.

    Share(generation, names, tensors)  ->     (the first sync, and again only when a storage changed)
                                       <-     Shared(generation) | Failed
    Load(version, generation)          ->     (the engine waits for the trainer's "ready" event, copies)
    End(0, bytes, fingerprints)        ->
                                       <-     Report | Failed (refused: a version going backwards)

Messages are small picklable dataclasses; weights never travel in them (only the handles of shared buffers
and storages, which torch.multiprocessing pickles as handles, not contents).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRANSPORTS: tuple[str, ...] = ("inprocess", "cuda_ipc", "shm", "broadcast")
TRANSPORT_CODES: dict[str, int] = {name: code for code, name in enumerate(TRANSPORTS)}
"""`sync/transport` in the float metrics: inprocess 0, cuda_ipc 1, shm 2, broadcast 3 (the name is logged)."""


class SyncError(RuntimeError):
    """A sync failed: the message names the tensor or the side at fault and what to do."""


class SyncRefused(SyncError):
    """The engine refused the sync (a weight version going backwards): nothing was loaded."""


class ChannelClosed(SyncError):
    """The other side closed the control channel (its process ended, or it closed its transport)."""


class SyncTimeout(SyncError, TimeoutError):
    """One side stopped answering within `weight_sync.timeout_s`; the message names it."""


@dataclass
class Connect:
    transport: str
    options: dict[str, Any] = field(default_factory=dict)
    """Transport-specific: shared buffers and events (shm, cuda_ipc) or the group's address (broadcast)."""


@dataclass
class Connected:
    engine: str
    dtype: str
    device: str
    weight_version: int
    options: dict[str, Any] = field(default_factory=dict)
    """Transport-specific answers (cuda_ipc: the engine's "buffer consumed" events)."""


@dataclass
class Begin:
    version: int
    verify: bool = True
    measure_memory: bool = False
    """Reset and report the engine's peak memory (benchmarks; the loop's own memory metrics stay whole)."""


@dataclass
class Ready:
    version: int


@dataclass
class Bucket:
    layout: Any
    """A `buckets.BucketLayout` (kept `Any` here so this module imports nothing)."""


@dataclass
class Ack:
    index: int


@dataclass
class End:
    buckets: int
    nbytes: int
    fingerprints: dict[str, int] | None
    """The sender's fingerprints of every tensor as sent (wire dtype); None when the sync is not verified."""


@dataclass
class Share:
    """The trainer's tensors a direct sync copies from: the engine opens the new ones and keeps the views."""

    generation: int
    """Counts the trainer's Shares on this connection; each Load names the one it copies from."""
    names: list[str]
    """Every tensor of the sync, in the trainer's order (a name missing here is dropped by the engine)."""
    tensors: dict[str, Any]
    """The tensors new or reallocated since the last Share (torch pickles them as handles of their storage
    with offset, shape, stride and dtype); the others' views stay as the engine opened them."""


@dataclass
class Shared:
    engine: str
    generation: int


@dataclass
class Load:
    """A direct sync of weight version `version` from the tensors of Share `generation`; an End follows."""

    version: int
    generation: int
    verify: bool = True
    measure_memory: bool = False


@dataclass
class Abort:
    reason: str


@dataclass
class Aborted:
    """The engine's answer to Abort: nothing of that sync follows on the channel."""

    engine: str


@dataclass
class Report:
    engine: str
    version: int
    checksum_ok: bool
    mismatched: list[str]
    load_seconds: float
    """From Begin to the engine holding every tensor (its device work finished)."""
    verify_seconds: float
    peak_bytes: int
    """The engine process's peak memory during the sync (`memory_kind` says which)."""
    memory_kind: str


@dataclass
class Failed:
    engine: str
    error: str
    refused: bool = False
    """A refusal before anything was loaded (version going backwards), not a failure part-way."""


@dataclass
class Disconnect:
    pass


@dataclass
class Disconnected:
    engine: str
