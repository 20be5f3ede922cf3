"""A sender whose engines can open the trainer's own storages (`shm`, `cuda_ipc`): with `direct` (the default)
a stream of persistent tensors (the torch backend's parameters) syncs without buckets.

The trainer shares its parameters' storages with the engines once (`Share`: per tensor a handle of its
storage with offset, shape, stride and dtype; the engine opens them and keeps the views), and again only for
tensors whose memory changed. Each sync is then one `Load` (version, which Share) and an `End` (the trainer's
fingerprints, computed while the engines copy): each engine waits for the trainer's "ready" event (cuda_ipc:
recorded on the trainer's stream after its optimizer step; its stream waits, its host does not), copies (and
casts) every view into its parameter through `Engine.update_weights`, waits for its device, verifies and
reports. The trainer must not modify the tensors until that report, which the loop's sequential sync ensures.

Direct mode allocates no bucket pool: a stream that must be bucketed (a converting one) allocates it at its
first sync and reconnects, the engines mapping it then (their views are dropped, shared again at the next
direct sync).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from miles.weight_sync.direct import SharedTensors, wire_bytes, wire_fingerprints
from miles.weight_sync.memory import start_peak
from miles.weight_sync.protocol import Connected, End, Load, Report, Shared, SyncError, SyncTimeout
from miles.weight_sync.result import TransportSyncResult
from miles.weight_sync.sender import WeightSender


class DirectSender(WeightSender):
    def __init__(self, *args: Any, direct: bool = True, **kwargs: Any) -> None:
        """`direct`: sync persistent tensors straight from the trainer's storages (False: always buckets, the
        pool allocated at connect)."""
        super().__init__(*args, **kwargs)
        self.direct = direct
        self.pooled = not direct
        """Whether the bucket pool is allocated (at connect, or at the first bucketed sync of direct mode)."""
        self._shared = SharedTensors()

    # what a transport provides -------------------------------------------------------------------
    @abstractmethod
    def share_device(self) -> torch.device:
        """Where the tensors the engines can open live (shm: the CPU; cuda_ipc: the trainer's GPU)."""

    def _prepare_share(self, tensor: torch.Tensor) -> None:  # noqa: B027 (an optional hook)
        """Before `tensor` is shared for the first time (shm: its storage moves into shared memory)."""

    def _mark_ready(self) -> None:  # noqa: B027 (an optional hook)
        """Just before a Load: what the engines wait for before copying (cuda_ipc: an event)."""

    # direct syncs --------------------------------------------------------------------------------
    def connect(self) -> list[Connected]:
        self._shared.reset()  # a (re)connected engine holds no view
        return super().connect()

    def _before_buckets(self) -> None:
        if not self.pooled and self.engines:
            self.pooled = True
            self.connect()  # the engines map the pool, once

    def takes_direct(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether `named` (persistent tensors) goes direct: direct mode, and every tensor can be shared."""
        device = self.share_device()
        return self.direct and all(t.device == device for _, t in named)

    def send_direct(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        version: int,
        verify: bool = True,
        measure_memory: bool = False,
    ) -> TransportSyncResult:
        """`send`, for tensors whose storages persist across syncs (`direct.persistent_tensors`): each engine
        copies straight from them. The same errors as `send`; the result says `path` "direct"."""
        self._check_usable()
        dtype = self.engine_dtype
        if measure_memory:
            start_peak(self.device)
        started = time.perf_counter()
        shared = self._share(named)
        try:
            self._mark_ready()
            for channel in self.channels:
                channel.send(Load(version, self._shared.generation, verify, measure_memory))
            # Counted and fingerprinted while the engines copy (both sides only read the tensors).
            nbytes = wire_bytes(named, dtype)
            fingerprints = wire_fingerprints(named, dtype) if verify else None
            for channel in self.channels:
                channel.send(End(0, nbytes, fingerprints))
            reports = [
                c.expect(Report, f"copying weight version {version} from the trainer's tensors")
                for c in self.channels
            ]
        except SyncTimeout as err:
            self.broken = str(err)
            raise
        except BaseException as err:
            self._abort(f"{type(err).__name__}: {err}")
            raise
        result = self._result(version, started, nbytes, fingerprints, reports, measure_memory, path="direct")
        result.shared = shared
        return result

    def _share(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Bring the engines' views up to `named`; returns how many tensors were (re)shared."""
        share = self._shared.update(named, self._prepare_share)
        if share is None:
            return 0
        try:
            for channel in self.channels:
                channel.send(share.message())
            for channel in self.channels:
                answer = channel.expect(Shared, f"opening the trainer's tensors (share {share.generation})")
                if answer.generation != share.generation:
                    raise SyncError(
                        f"{channel.peer} opened the trainer's share {answer.generation} when {share.generation} "
                        "was due: the two sides disagree; reconnect the transport"
                    )
        except SyncTimeout as err:
            self.broken = str(err)
            raise
        except BaseException as err:
            self._shared.reset()  # some engines may hold views, some not: the next sync shares everything
            self._abort(f"{type(err).__name__}: {err}")  # reads the other engines' answers off their channels
            raise
        return len(share.tensors)

    def _release(self) -> None:
        self._shared.reset()
