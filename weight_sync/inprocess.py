"""Trainer -> engine weight sync inside one process (the embedded placement).

When the engine runs the trainer's own module (same dtype and device) nothing is copied: the sync only
bumps the version and flushes the engine's prefix cache. Otherwise tensors are copied (and cast) in buckets:
the trainer's parameters, or with another model definition (the megatron backend) the stream of its
`iter_engine_weights()`, its weights converted (and gathered) into the engine model's names and layouts.
A checksum of both sides proves they agree after every sync where tensors were copied: each tensor against
the place the engine copied it into (so Hugging Face names, which the engine takes too, and a tied
`lm_head.weight`, which it skips, are checked against what the engine holds), and every engine parameter
must have been written. Where the engine runs the trainer's own module there is one side only
(`checksum_ok` holds by identity), and the trainer's fingerprints still go to the data-parallel replicas'
comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from miles.weight_sync.checksum import tensor_fingerprint
from miles.weight_sync.places import Place, check_places, engine_places


@dataclass
class SyncResult:
    version: int
    seconds: float
    bytes: int
    checksum_ok: bool
    mismatched: list[str]
    fingerprints: dict[str, int] = field(default_factory=dict)
    """The trainer's weights' fingerprints, bit for bit in their own dtype (when verified): ranks of a
    data-parallel run compare theirs to prove their replicas are identical."""

    def metrics(self) -> dict[str, float]:
        return {
            "sync/seconds": self.seconds,
            "sync/bytes": float(self.bytes),
            "sync/checksum_ok": float(self.checksum_ok),
            "sync/version": float(self.version),
        }


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class InProcessWeightSync:
    def __init__(
        self,
        trainer_model: torch.nn.Module,
        engine: object,
        bucket_bytes: int = 256 * 1024 * 1024,
        verify: bool = True,
        replica_fingerprints: bool = True,
    ) -> None:
        """`replica_fingerprints`: return the trainer's fingerprints (`SyncResult.fingerprints`) for the
        data-parallel replicas' comparison; without it a sync over shared weights reads no tensor at all."""
        self.trainer_model, self.engine = trainer_model, engine
        self.bucket_bytes, self.verify = bucket_bytes, verify
        self.replica_fingerprints = replica_fingerprints

    @property
    def shares_weights(self) -> bool:
        return self.engine.model is self.trainer_model

    def _named(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The trainer's weights in the engine's names: a stream where the trainer converts (or gathers)
        them, so the sync holds one bucket of converted tensors at a time, not a second copy of the model."""
        export = getattr(self.trainer_model, "iter_engine_weights", None)
        if export is not None:
            return export()
        return [(n, p.detach()) for n, p in self.trainer_model.named_parameters()]

    def _engine_places(self) -> Callable[[str], Place | None]:
        """Where the engine keeps a streamed tensor (`places.engine_places`)."""
        return engine_places(self.engine.model)

    def sync(self, version: int) -> SyncResult:
        start = time.perf_counter()
        engine_dtype = self.engine.model.dtype
        expected: dict[str, int] = {}
        own: dict[str, int] = {}
        moved = 0
        place = self._engine_places() if self.verify and not self.shares_weights else None
        places: dict[str, Place | None] = {}
        """Each streamed name's place in the engine (None: one it does not keep), for the check after."""
        refused: set[str] = set()
        """Streamed names the engine has no place for (it refuses them, saying why)."""

        def passing(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            """Each tensor on its way to the engine, counted and fingerprinted (as the engine will store it,
            and bit for bit in its own dtype for the replicas' comparison)."""
            nonlocal moved
            for name, tensor in named:
                dtype = engine_dtype
                if place is not None:
                    try:
                        found = places[name] = place(name)
                    except KeyError:
                        found = None
                        refused.add(name)
                    dtype = found[1].dtype if found is not None else engine_dtype
                moved += tensor.numel() * dtype.itemsize
                if self.verify:
                    expected[name] = tensor_fingerprint(tensor.to(dtype))
                    same = tensor.dtype == dtype
                    own[name] = expected[name] if same else tensor_fingerprint(tensor)
                yield name, tensor

        if self.shares_weights:
            self.engine.update_weights([], version)
            if self.verify and self.replica_fingerprints:  # nothing else reads them: one side only
                for _ in passing(self._named()):
                    pass
            moved = 0
        else:
            self.engine.update_weights(iter_buckets(passing(self._named()), self.bucket_bytes), version)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        mismatched: list[str] = []
        if place is not None:  # shared: the engine's tensors are the trainer's
            mismatched = self._check_engine(expected, places, refused)
        return SyncResult(version, seconds, moved, not mismatched, mismatched, own)

    def _check_engine(
        self,
        expected: dict[str, int],
        places: dict[str, Place | None],
        refused: set[str],
    ) -> list[str]:
        """The streamed names the engine refused or does not hold bit for bit, and its parameters no streamed
        tensor went into (`places.check_places`)."""
        return check_places(self.engine.model, expected, places, refused)
