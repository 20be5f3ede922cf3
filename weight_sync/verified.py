"""A sync the run can trust: verified by checksums (and, with data-parallel ranks, by every replica
holding rank 0's weights), repeated once on a mismatch, and otherwise the end of the run: the engine
would generate from weights the policy does not have."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.distributed import DataParallel

log = logging.getLogger("miles.weight_sync")

SYNC_RETRIES = 1
"""Syncs repeated after a checksum mismatch before the run stops (a repeat that matches costs nothing)."""


@dataclass
class VerifiedSync:
    result: Any  # SyncResult of the last attempt
    seconds: float
    """All attempts together."""
    retries: int
    checks: dict[str, float] = field(default_factory=dict)
    """Batch-wide: `sync/checksum_ok` of every rank and `sync/replicas_equal` (data-parallel runs)."""

    def own_metrics(self) -> dict[str, float]:
        return {**self.result.metrics(), "time/sync": self.seconds, "sync/retries": float(self.retries)}


def sync_verified(
    sync: Any, version: int, dp: DataParallel, checkpoints: Path, retries: int = SYNC_RETRIES
) -> VerifiedSync:
    """`sync.sync(version)` until every rank's checksums hold, at most `1 + retries` times; then a
    RuntimeError that names the checkpoints to resume from."""
    seconds = 0.0
    for attempt in range(1 + retries):
        result = sync.sync(version=version)
        seconds += result.seconds
        checks = replica_metrics(dp, result) if dp.enabled else {}
        if checks.get("sync/checksum_ok", result.checksum_ok):  # every rank's, where ranks compare
            break
        log.error("weight sync checksum mismatch after step %d: %s", version, result.mismatched[:5])
        if attempt == retries:
            raise RuntimeError(
                f"the engine's weights differ from the policy's after step {version} and {retries} more "
                f"sync(s) (first differing: {result.mismatched[:5]}); the last checkpoint is in "
                f"{checkpoints} (resume with trainer.resume_from)"
            )
    if not checks.get("sync/replicas_equal", 1.0):
        log.error("after step %d the ranks' weights differ", version)
    return VerifiedSync(result, seconds, attempt, checks)


def replica_metrics(dp: DataParallel, result: Any) -> dict[str, float]:
    """`sync/checksum_ok` of every rank, and whether every rank's weights equal rank 0's, bit for bit."""
    ok = dp.all_reduce_floats([float(result.checksum_ok)], "min")[0]
    prints = dp.all_gather_objects(result.fingerprints)
    equal = all(p == prints[0] for p in prints[1:])
    return {"sync/checksum_ok": ok, "sync/replicas_equal": float(equal)}
