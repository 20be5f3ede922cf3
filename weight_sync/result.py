"""What a sync over a transport reports: the in-process `SyncResult` plus the transport's own numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.weight_sync.inprocess import SyncResult
from miles.weight_sync.protocol import TRANSPORT_CODES, Report


@dataclass
class TransportSyncResult(SyncResult):
    """`seconds`: the whole sync as the trainer waits for it (begin, transfer, load, verification, reports).
    `fingerprints`: the sender's, of the tensors as sent (the engine's dtype), for the replicas' comparison;
    empty on a trainer rank that only took part in the gathers (`sent` False)."""

    transport: str = "shm"
    load_seconds: float = 0.0
    """The slowest engine's time from accepting the sync to holding every new tensor (device work done)."""
    verify_seconds: float = 0.0
    """The slowest engine's fingerprinting of what it holds and comparison with the sender's."""
    buckets: int = 0
    path: str = "buckets"
    """`direct`: the engines copied straight from the trainer's shared tensors (no bucket); `buckets`: packed
    into the transport's buffers."""
    shared: int = 0
    """Direct: the tensors whose storage handles went to the engines in this sync (all of them at the first,
    then only those the trainer reallocated)."""
    sent: bool = True
    sender_peak_bytes: int = 0
    engine_peak_bytes: int = 0
    memory_kind: str = ""
    """What the peaks measure (`memory.read_peak`); empty when not measured (the loop does not ask)."""
    reports: list[Report] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        """Bytes moved over the time the engines took to receive and load them (1e9 bytes a GB)."""
        return self.bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            **super().metrics(),
            "sync/gb_per_s": self.gb_per_s,
            "sync/load_seconds": self.load_seconds,
            "sync/verify_seconds": self.verify_seconds,
            "sync/transport": float(TRANSPORT_CODES[self.transport]),
            "sync/direct": float(self.path == "direct"),
        }
