"""The trainer side of a sync over a transport: buckets packed from a stream of named tensors, handed to one
or more engines through a small pool of buffers, each engine acknowledging each bucket.

The protocol (protocol.py) and the bucket layout (buckets.py) are the same for every transport; a transport
only says where its buffers live and how a packed bucket reaches the engines (`_connect_options`, `_reclaim`,
`_publish`). Bucket k goes into buffer k % buffers; before buffer i is packed again the sender waits for every
engine's Ack of the bucket that used it last, so packing bucket k+1 overlaps the engines' copies of bucket k
and the trainer never runs more than `buffers` buckets ahead.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from miles.weight_sync.buckets import (
    BucketLayout,
    check_bucket_bytes,
    fingerprint_slots,
    pack,
    plan_buckets,
    sum_fingerprints,
    wire_dtype,
)
from miles.weight_sync.channel import Channel
from miles.weight_sync.memory import read_peak, start_peak
from miles.weight_sync.protocol import (
    Abort,
    Aborted,
    Ack,
    Begin,
    Connect,
    Connected,
    Disconnect,
    Disconnected,
    End,
    Failed,
    Ready,
    Report,
    SyncError,
    SyncTimeout,
)
from miles.weight_sync.result import TransportSyncResult

log = logging.getLogger(__name__)


class WeightSender(ABC):
    transport: ClassVar[str]

    def __init__(
        self,
        channels: Sequence[Channel],
        bucket_bytes: int = 512 * 1024**2,
        timeout_s: float = 300.0,
        buffers: int = 2,
        device: str | torch.device = "cpu",
    ) -> None:
        """`channels`: one per engine (their control channels); `buffers`: the pool's size (2: double
        buffering); `device`: where the trainer's tensors are packed (the pool lives there)."""
        if not channels:
            raise ValueError("a weight sender needs at least one engine channel")
        if buffers < 1:
            raise ValueError(f"a weight sender needs at least one buffer, got {buffers}")
        self.channels = list(channels)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.timeout_s, self.buffers = float(timeout_s), int(buffers)
        self.device = torch.device(device)
        self.engines: list[Connected] = []
        self.broken: str | None = None
        """Why the transport cannot be used any more (a side stopped answering): close it, connect anew."""

    # what a transport provides -------------------------------------------------------------------
    @abstractmethod
    def _connect_options(self, engine: int) -> dict[str, Any]:
        """What engine number `engine` needs to open the transport (its `Connect.options`)."""

    def _open(self) -> None:  # noqa: B027 (an optional hook)
        """After every Connect went out, before the Connected answers are read (a group forms here)."""

    def _opened(self, engines: list[Connected]) -> None:  # noqa: B027 (an optional hook)
        """With the engines' answers (their events, say)."""

    @abstractmethod
    def _buffer(self, index: int) -> torch.Tensor:
        """Flat uint8 buffer `index` of the pool."""

    def _before_buckets(self) -> None:  # noqa: B027 (an optional hook)
        """At the start of a bucketed sync (a pool allocated only when a stream needs it is opened here)."""

    def _reclaim(self, index: int) -> None:  # noqa: B027 (an optional hook)
        """Before buffer `index` is packed: what the engines' Acks of its last bucket do not already ensure."""

    @abstractmethod
    def _publish(self, layout: BucketLayout) -> None:
        """Hand the packed bucket to every engine (its Bucket message, and whatever moves the bytes)."""

    def _release(self) -> None:  # noqa: B027 (an optional hook)
        """Free the transport's resources (after the engines disconnected)."""

    # the protocol --------------------------------------------------------------------------------
    def connect(self) -> list[Connected]:
        """Open the transport to every engine; returns their answers (dtype, device, weight version)."""
        for i, channel in enumerate(self.channels):
            channel.send(Connect(self.transport, self._connect_options(i)))
        self._open()
        self.engines = [
            c.expect(Connected, f"connecting the {self.transport} weight sync") for c in self.channels
        ]
        dtypes = {e.dtype for e in self.engines}
        if len(dtypes) > 1:
            raise SyncError(
                f"the engines of one {self.transport} sync hold different dtypes ({sorted(dtypes)}); give them "
                "one model.dtype, or one sender each"
            )
        self._opened(self.engines)
        return self.engines

    @property
    def engine_dtype(self) -> torch.dtype:
        if not self.engines:
            raise SyncError(f"the {self.transport} weight sender is not connected; call connect() first")
        return getattr(torch, self.engines[0].dtype)

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        verify: bool = True,
        measure_memory: bool = False,
    ) -> TransportSyncResult:
        """Push the named tensors (a stream: converted, gathered, one bucket at a time) to every engine as
        weight version `version`; each engine loads them, and with `verify` checks bit for bit what it then
        holds against the sender's fingerprints. Raises SyncRefused (nothing loaded) for a version going
        backwards, SyncTimeout naming an engine that stopped answering, SyncError naming a tensor that could
        not be loaded; a mismatch is `checksum_ok` False with the tensors' names in `mismatched`."""
        self._check_usable()
        self._before_buckets()
        dtype = self.engine_dtype
        if measure_memory:
            start_peak(self.device)
        started = time.perf_counter()
        for channel in self.channels:
            channel.send(Begin(version, verify, measure_memory))
        try:
            for channel in self.channels:
                channel.expect(Ready, f"starting the sync of weight version {version}")
            count, nbytes, prints = self._stream(named, dtype, verify)
            fingerprints = sum_fingerprints(prints) if verify else None
            for channel in self.channels:
                channel.send(End(count, nbytes, fingerprints))
            reports = [
                c.expect(Report, f"loading and verifying weight version {version}") for c in self.channels
            ]
        except SyncTimeout as err:
            self.broken = str(err)
            raise
        except BaseException as err:
            self._abort(f"{type(err).__name__}: {err}")
            raise
        return self._result(version, started, nbytes, fingerprints, reports, measure_memory, buckets=count)

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise SyncError(
                f"the {self.transport} weight sync is broken ({self.broken}); close it and connect a new one"
            )

    def _result(
        self,
        version: int,
        started: float,
        nbytes: int,
        fingerprints: dict[str, int] | None,
        reports: list[Report],
        measure_memory: bool,
        **path: object,
    ) -> TransportSyncResult:
        """The sync's result from the engines' reports; `path`: how it went (`buckets`, or `path="direct"`
        and the tensors `shared`)."""
        seconds = time.perf_counter() - started
        sender_peak, memory_kind = read_peak(self.device) if measure_memory else (0, "")
        mismatched = sorted({name for r in reports for name in r.mismatched})
        return TransportSyncResult(
            version=version,
            seconds=seconds,
            bytes=nbytes,
            checksum_ok=all(r.checksum_ok for r in reports),
            mismatched=mismatched,
            fingerprints=fingerprints or {},
            transport=self.transport,
            load_seconds=max(r.load_seconds for r in reports),
            verify_seconds=max(r.verify_seconds for r in reports),
            sender_peak_bytes=sender_peak,
            engine_peak_bytes=max(r.peak_bytes for r in reports),
            memory_kind=memory_kind,
            reports=reports,
            **path,  # type: ignore[arg-type]
        )

    def _stream(
        self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, verify: bool
    ) -> tuple[int, int, list[tuple[str, torch.Tensor]]]:
        """Pack and publish every bucket; returns (buckets, bytes, the fingerprints of the packed slots)."""
        prints: list[tuple[str, torch.Tensor]] = []
        count = nbytes = 0
        for k, planned in enumerate(plan_buckets(named, self.bucket_bytes, lambda t: wire_dtype(t, dtype))):
            index = k % self.buffers
            if k >= self.buffers:
                self._await_acks(k - self.buffers)
            self._reclaim(index)
            buffer = self._buffer(index)
            pack(buffer, planned)
            self._publish(BucketLayout(k, index, tuple(planned.slots)))
            if verify:  # after publishing: the engines copy the bucket out meanwhile
                prints += fingerprint_slots(buffer, planned.slots)
            nbytes += sum(slot.nbytes for slot in planned.slots)
            count = k + 1
        for k in range(max(0, count - self.buffers), count):
            self._await_acks(k)
        return count, nbytes, prints

    def _await_acks(self, index: int) -> None:
        for channel in self.channels:
            ack = channel.expect(Ack, f"copying out bucket {index}")
            if ack.index != index:
                raise SyncError(
                    f"{channel.peer} acknowledged bucket {ack.index} when bucket {index} was due: the two sides "
                    "disagree about the stream; reconnect the transport"
                )

    def _abort(self, reason: str) -> None:
        """Tell every engine the sync is off and read their channels up to its answer, so the next sync starts
        clean (the engines' weights are then a mix: the next sync must be a whole one)."""
        for channel in self.channels:
            try:
                channel.send(Abort(reason))
            except SyncError:
                pass
        for channel in self.channels:
            try:
                while True:
                    message = channel.recv("aborting the sync")
                    if isinstance(message, Failed):
                        log.warning("weight sync: %s: %s", message.engine, message.error)
                    if isinstance(message, Aborted):
                        break
            except SyncError as err:
                self.broken = f"aborting a failed sync: {err}"
                log.warning("weight sync: %s", err)

    def close(self) -> None:
        """Disconnect every engine, then free the pool (engines drop their handles to it first)."""
        try:
            if self.broken is None:
                for channel in self.channels:
                    channel.send(Disconnect())
                for channel in self.channels:
                    channel.expect(Disconnected, f"disconnecting the {self.transport} weight sync")
        finally:
            self._release()
            self.engines = []
