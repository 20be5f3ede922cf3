"""The driver's handles on the trainer ranks: the trainer side of the loop (`RayTrainerSide.train`) and the
weight sync into the engines (`RaySync.sync`), each a call on every rank actor at once."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from miles.placement.ray.cluster import Layout
from miles.sample import Sample
from miles.weight_sync.result import TransportSyncResult


def shard_by_group(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Rank r trains on the groups whose id is r modulo the ranks: those the embedded placement's rank r
    generates and trains (`DataParallel.shard` of the batch; a group's id is its place in the step)."""
    shards: list[list[Sample]] = [[] for _ in range(world_size)]
    for sample in samples:
        shards[sample.group_id % world_size].append(sample)
    return shards


class TrainerRankFailed(RuntimeError):
    """A trainer rank died or raised; the message names it and how to resume."""


DEATH_GRACE_S = 5.0
"""How long a rank's error waits for news of another rank's death: a rank whose collective peer is killed
fails at once (the connection closed), often before Ray reports the death that caused it."""


def gather_ranks(refs: list[Any], what: str, rank_ids: list[int] | None = None) -> list[Any]:
    """The results of calls on trainer ranks (`rank_ids[i]` made `refs[i]`; default: rank i); the first
    rank to fail ends the wait (the others may be blocked in a collective with it, which would only end at
    the group's timeout). A rank that died is named over one that raised within `DEATH_GRACE_S` of it."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as err:
            failed, error = done[0], err
            if not isinstance(err, ray.exceptions.RayActorError) and pending:
                failed, error = _first_death(pending, DEATH_GRACE_S) or (failed, error)
            position = refs.index(failed)
            rank = rank_ids[position] if rank_ids is not None else position
            died = isinstance(error, ray.exceptions.RayActorError)
            # Ray's own text runs to a dozen lines: its first says what happened; the full error is chained.
            text = str(error).strip()
            first_line = text.splitlines()[0] if text else type(error).__name__
            raise TrainerRankFailed(
                f"trainer rank {rank} {'died' if died else 'failed'} while {what} ({first_line}). The run stops; "
                "resume it from its last checkpoint with trainer.resume_from=auto (or the run folder)"
            ) from error
    return ray.get(refs)


def _first_death(pending: list[Any], grace_s: float) -> tuple[Any, Exception] | None:
    """(ref, error) of a call in `pending` whose actor died within `grace_s`, else None."""
    import ray

    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return ref, err
            except ray.exceptions.RayError:
                pass
    return None


class RayTrainerSide:
    """The loop's trainer side over rank actors (no draft training on this placement)."""

    draft_trainer = None
    head = None

    def __init__(self, ranks: list[Any], reserve_bytes: int) -> None:
        self.ranks, self.reserve_bytes = ranks, reserve_bytes

    def memory_reserve_bytes(self) -> int:
        return self.reserve_bytes

    def train(
        self, rollouts: list[Sample], samples: list[Sample], update: bool, timings: dict[str, float]
    ) -> dict[str, float]:
        """Each rank's share of `samples` (the trainer sums gradients and metrics over the ranks, so rank
        0's metrics are the step's)."""
        shards = shard_by_group(samples, len(self.ranks))
        calls = [rank.train.remote(shard, update) for rank, shard in zip(self.ranks, shards)]
        return gather_ranks(calls, "training")[0]


class RaySync:
    """The new weights from the trainer ranks into every engine: colocated, each rank into its own engine
    (shm / cuda_ipc); disaggregated, rank 0 into all of them in one broadcast group. Every engine verifies
    what it holds."""

    def __init__(self, ranks: list[Any], layout: Layout, connect_options: dict[str, Any]) -> None:
        self.ranks, self.layout, self.options = ranks, layout, connect_options
        self.addresses: dict[int, Any] = {}
        """Each engine's sync socket."""
        self.fleet: Any = None
        """The engines (set once they run): a sync restarts one that died."""

    def connect(self, addresses: dict[int, Any]) -> dict[int, Any]:
        """Engines now listening at `addresses` (started, or restarted): the rank that syncs each reconnects
        to all of its engines. Returns each given engine's connecting call (a Ray ref, not waited for: it
        completes once every engine of the rank serves, which waits for the driver to attach it)."""
        self.addresses.update(addresses)
        calls = {}
        for rank in sorted({self.layout.sender_of(e) for e in addresses}):
            mine = {e: a for e, a in self.addresses.items() if self.layout.sender_of(e) == rank}
            call = self.ranks[rank].connect_sync.remote(mine, **self.options)
            calls.update({e: call for e in addresses if self.layout.sender_of(e) == rank})
        return calls

    def sync(self, version: int) -> TransportSyncResult:
        """Every engine to `version`. Where a rank's sync failed and an engine of it is found dead, that
        engine is restarted (the rank reconnects and syncs all its engines); any other failure ends the run."""
        began = time.perf_counter()
        senders = self._senders()
        calls = [self.ranks[r].sync.remote(version) for r in senders]
        results = gather_ranks(calls, "syncing weights", senders)
        for i, (rank, result) in enumerate(zip(senders, results)):
            if not isinstance(result, str):
                continue
            dead = [
                e
                for e in self._engines_of(rank)
                if self.fleet is not None and not self.fleet.engines[e].alive
            ]
            if not dead:
                raise RuntimeError(f"the weight sync from trainer rank {rank} failed: {result}")
            for engine in dead:
                results[i] = self.fleet.restart(engine)
        return merge_results(results, version, time.perf_counter() - began)

    def sync_engine(self, engine: int) -> TransportSyncResult:
        """The policy's current weights into a restarted engine (and the others its rank syncs). With the
        rollout one step ahead the update may have finished meanwhile: they then hold (and their samples
        carry) the newer version."""
        rank = self.layout.sender_of(engine)
        result = gather_ranks([self.ranks[rank].sync.remote(None)], "syncing a restarted engine", [rank])[0]
        if isinstance(result, str) or not result.checksum_ok:
            why = result if isinstance(result, str) else result.mismatched[:5]
            raise RuntimeError(f"restarted engine-{engine} did not take the weights: {why}")
        return result

    def _senders(self) -> list[int]:
        return sorted({self.layout.sender_of(e) for e in range(self.layout.engines)})

    def _engines_of(self, rank: int) -> list[int]:
        return [e for e in range(self.layout.engines) if self.layout.sender_of(e) == rank]

    def close(self) -> None:
        """Close the senders (the engines answer their Disconnect) and the ranks' group; a dead rank is
        passed over."""
        import ray

        # A rank stuck in a collective with a dead one never answers: the caller kills the ranks after this.
        ray.wait([rank.shutdown.remote() for rank in self.ranks], num_returns=len(self.ranks), timeout=30)


@dataclass
class FleetSyncResult(TransportSyncResult):
    replicas_equal: bool = True
    """Every sending rank's weights were rank 0's, bit for bit (colocated: each rank syncs its own replica)."""

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "sync/replicas_equal": float(self.replicas_equal)}


def merge_results(results: list[TransportSyncResult], version: int, seconds: float) -> FleetSyncResult:
    """One result for every sending rank's sync: verified only if every engine's is and every sender's
    weights agree; bytes added; the slowest engine's times."""
    first = results[0]
    prints = [r.fingerprints for r in results if r.fingerprints]
    equal = all(p == prints[0] for p in prints[1:])
    return FleetSyncResult(
        version,
        seconds,
        sum(r.bytes for r in results),
        all(r.checksum_ok for r in results) and equal,
        [name for r in results for name in r.mismatched]
        + ([] if equal else ["(the ranks' replicas differ)"]),
        first.fingerprints,
        transport=first.transport,
        load_seconds=max(r.load_seconds for r in results),
        verify_seconds=max(r.verify_seconds for r in results),
        buckets=sum(r.buckets for r in results),
        path=first.path,
        replicas_equal=equal,
    )
