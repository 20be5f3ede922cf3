"""The engine side of a sync over a transport: `EngineSyncTarget(engine, channel)` makes an `Engine` in this
process the receiving end of the weight syncs its trainer sends on `channel` (engine_process.py runs one in a
spawned process; a Ray actor could run one the same way).

Each sync goes through `Engine.update_weights` with the received tensors streamed into it, so in-flight
requests follow the engine's own policy (finish them on the old weights, or retract and restart them on the
new), the radix cache is flushed and every later sample carries the new `weight_version`. Then the engine
fingerprints what it actually holds, each tensor's place in its model, and compares with the sender's.

The tensors come out of buckets (`Begin`, then `Bucket`s), or in a direct sync (`Load`) straight from the
trainer's own tensors, whose views the engine opened once (`Share`, kept in `DirectViews`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from miles.weight_sync.buckets import BucketLayout, Destination, Reassembly, TensorSlot, slot_view
from miles.weight_sync.channel import Channel
from miles.weight_sync.direct_views import DirectViews
from miles.weight_sync.memory import read_peak, start_peak, synchronize
from miles.weight_sync.places import Place, check_places, engine_places
from miles.weight_sync.protocol import (
    Abort,
    Aborted,
    Ack,
    Begin,
    Bucket,
    Connect,
    Connected,
    Disconnect,
    Disconnected,
    End,
    Failed,
    Load,
    Ready,
    Report,
    Share,
    Shared,
    SyncError,
    SyncTimeout,
)
from miles.weight_sync.receiver import WeightReceiver
from miles.weight_sync.transports import make_receiver

log = logging.getLogger(__name__)


class _AbortedByTrainer(SyncError):
    pass


@dataclass
class _SyncState:
    version: int
    started: float = 0.0
    """When the engine was ready to load (its in-flight requests finished or retracted)."""
    end: End | None = None
    buckets: int = 0
    last_name: str = ""
    """The last tensor received, for errors about what came after it."""


class EngineSyncTarget:
    def __init__(self, engine: Any, channel: Channel, name: str = "engine") -> None:
        """`engine`: an `Engine` (anything with `model`, `weight_version` and `update_weights(weights,
        version)`); `channel`: the control channel from its trainer; `name`: how errors name this engine."""
        self.engine, self.channel, self.name = engine, channel, name
        self.receiver: WeightReceiver | None = None
        self.views: DirectViews | None = None
        """The trainer's shared tensors (direct syncs), opened once per Share."""
        self.transport = ""
        self.last_report: Report | None = None

    @property
    def device(self) -> torch.device:
        device = getattr(self.engine, "device", None)
        return torch.device(device) if device is not None else next(self.engine.model.parameters()).device

    def serve_pending(self) -> None:
        """Handle every message waiting on the channel (a whole sync once its Begin is there)."""
        while self.channel.poll():
            self.handle(self.channel.recv("reading the next message"))

    def handle(self, message: object) -> Report | None:
        """One message from the trainer; a Begin runs the whole sync it starts. A sync that fails is reported
        to the trainer, then raised here."""
        if isinstance(message, Begin):
            state = _SyncState(message.version)
            return self._sync(message.version, message.measure_memory, state, self._stream(state))
        if isinstance(message, Load):
            state = _SyncState(message.version)
            return self._sync(message.version, message.measure_memory, state, self._direct(message, state))
        if isinstance(message, Connect):
            self._connect(message)
        elif isinstance(message, Share):
            self._open_shared(message)
        elif isinstance(message, End):  # of a direct sync this engine refused: its Abort follows
            pass
        elif isinstance(message, Abort):  # of a sync this engine refused, or already failed
            self.channel.send(Aborted(self.name))
        elif isinstance(message, Disconnect):
            self._close_receiver()
            self.channel.send(Disconnected(self.name))
        else:
            log.warning("%s: ignored %s outside a sync", self.name, type(message).__name__)
        return None

    def _connect(self, message: Connect) -> None:
        self._close_receiver()
        try:
            self.receiver = make_receiver(message, self.device, self.channel.timeout_s)
        except Exception as err:
            self.channel.send(Failed(self.name, f"could not open the {message.transport} transport: {err}"))
            raise
        self.transport = message.transport
        dtype = str(self.engine.model.dtype).removeprefix("torch.")
        answer = Connected(
            self.name, dtype, str(self.device), int(self.engine.weight_version), self.receiver.answer()
        )
        self.channel.send(answer)

    def _open_shared(self, message: Share) -> None:
        try:
            if self.receiver is None:
                raise SyncError("no transport is connected; call the sender's connect() first")
            if self.views is None:
                self.views = DirectViews()
            self.views.update(message)
        except Exception as err:
            self.views = None  # the trainer shares every tensor again at its next sync
            self.channel.send(Failed(self.name, f"could not open the trainer's shared tensors: {err}"))
            raise
        self.channel.send(Shared(self.name, message.generation))

    def close(self) -> None:
        """Drop the transport and the trainer's shared tensors (the trainer went away without Disconnect)."""
        self._close_receiver()
        self.channel.close()

    def _close_receiver(self) -> None:
        self.views = None  # first: the trainer's memory is released with them
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    # one sync ------------------------------------------------------------------------------------
    def _sync(
        self,
        version: int,
        measure_memory: bool,
        state: _SyncState,
        stream: Iterator[tuple[str, torch.Tensor]],
    ) -> Report | None:
        """Load `stream` (the buckets' or a direct sync's, which fills `state`) as weight `version`, verify
        what the engine then holds, report."""
        current = int(self.engine.weight_version)
        if self.receiver is None:
            self.channel.send(
                Failed(self.name, "no transport is connected; call the sender's connect() first")
            )
            return None
        if version < current:
            self.channel.send(
                Failed(
                    self.name,
                    f"refused weight version {version}: it holds version {current}, and versions must not "
                    "go backwards (a stale trainer, or a resumed run syncing an older checkpoint?); nothing was "
                    "loaded",
                    refused=True,
                )
            )
            return None
        if measure_memory:
            start_peak(self.device)
        try:
            self.engine.update_weights(stream, version)
            synchronize(self.device)
            if state.end is None:
                raise SyncError("the engine's update_weights returned before reading the whole sync")
        except BaseException as err:
            self._fail(err, state)
            raise
        loaded = time.perf_counter()
        started = state.started
        mismatched: list[str] = []
        if state.end.fingerprints is not None:
            mismatched = self._verify(state.end.fingerprints)
        verified = time.perf_counter()
        peak, kind = read_peak(self.device) if measure_memory else (0, "")
        if mismatched:
            log.error(
                "%s: weight version %d differs from the trainer's in %d tensor(s): %s",
                self.name,
                version,
                len(mismatched),
                mismatched[:5],
            )
        report = Report(
            self.name,
            version,
            not mismatched,
            mismatched,
            loaded - started,
            verified - loaded,
            peak,
            kind,
        )
        self.channel.send(report)
        self.last_report = report
        return report

    def _stream(self, state: _SyncState) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync's tensors as the engine's `update_weights` takes them, read bucket by bucket off the
        transport: each whole tensor a view into the bucket (copied out by the engine before the bucket is
        acknowledged), each tensor larger than a bucket once its last piece is in."""
        receiver = self.receiver
        assert receiver is not None
        reassembly = Reassembly(self.device, self._destination())
        # Ready only now: the engine has finished (or retracted) its in-flight requests and starts loading.
        self.channel.send(Ready(state.version))
        state.started = time.perf_counter()
        while True:
            message = self.channel.recv(
                f"waiting for bucket {state.buckets} of weight version {state.version} (after tensor "
                f"{state.last_name or 'none'})"
            )
            if isinstance(message, End):
                if message.buckets != state.buckets:
                    raise SyncError(
                        f"the trainer sent {message.buckets} buckets of weight version {state.version} but "
                        f"{state.buckets} arrived; the stream lost some after tensor {state.last_name!r}"
                    )
                reassembly.check_complete()
                state.end = message
                return
            if isinstance(message, Abort):
                raise _AbortedByTrainer(
                    f"the trainer aborted the sync of weight version {state.version}: {message.reason}"
                )
            if not isinstance(message, Bucket):
                raise SyncError(
                    f"{type(message).__name__} arrived in the middle of a sync; expected a bucket"
                )
            layout: BucketLayout = message.layout
            if layout.index != state.buckets:
                raise SyncError(
                    f"bucket {layout.index} arrived when bucket {state.buckets} was due: a bucket after tensor "
                    f"{state.last_name!r} was lost"
                )
            buffer = receiver.acquire(layout)
            for slot in layout.slots:
                view = slot_view(buffer, slot)
                state.last_name = slot.name
                if slot.whole:
                    yield slot.name, view
                    continue
                done = reassembly.add(slot, view)
                if done is not None and not done[2]:
                    yield done[0], done[1]
            receiver.release(layout)
            self.channel.send(Ack(layout.index))
            state.buckets += 1

    def _direct(self, load: Load, state: _SyncState) -> Iterator[tuple[str, torch.Tensor]]:
        """A direct sync's tensors: the views of the trainer's own, once the trainer's writes to them are done
        (the engine copies each into its place before asking for the next), then its End."""
        receiver, views = self.receiver, self.views
        assert receiver is not None
        if views is None or views.generation != load.generation:
            held = "none" if views is None else f"share {views.generation}"
            raise SyncError(
                f"the trainer loads from its share {load.generation} but this engine holds {held} (a Share "
                "failed or was lost); reconnect the transport"
            )
        state.started = time.perf_counter()
        receiver.wait_shared()
        for name, view in views.tensors():
            state.last_name = name
            yield name, view
        message = self.channel.recv(f"waiting for the end of weight version {state.version} (direct)")
        if isinstance(message, Abort):
            raise _AbortedByTrainer(
                f"the trainer aborted the sync of weight version {state.version}: {message.reason}"
            )
        if not isinstance(message, End):
            raise SyncError(f"{type(message).__name__} arrived at the end of a direct sync; expected End")
        state.end = message

    def _destination(self) -> Destination:
        """A tensor larger than a bucket goes straight into the engine parameter that holds it whole (its own
        name, dtype and shape, contiguous); anything else (a Hugging Face part, a tied lm_head the engine skips,
        a cast) is reassembled and handed to the engine like the rest."""
        place = engine_places(self.engine.model)

        def destination(slot: TensorSlot) -> torch.Tensor | None:
            try:
                found = place(slot.name)
            except KeyError:
                return None  # the engine names it in its own error
            if found is None:
                return None
            owner, view = found
            if owner != slot.name or view.dtype != slot.torch_dtype or tuple(view.shape) != slot.shape:
                return None
            return view.view(-1) if view.is_contiguous() else None

        return destination

    def _verify(self, expected: dict[str, int]) -> list[str]:
        place = engine_places(self.engine.model)
        places: dict[str, Place | None] = {}
        refused: set[str] = set()
        for name in expected:
            try:
                places[name] = place(name)
            except KeyError:
                refused.add(name)
        return check_places(self.engine.model, expected, places, refused)

    def _fail(self, err: BaseException, state: _SyncState) -> None:
        """Tell the trainer, and read the rest of the sync off the channel (taking part in each announced
        bucket, which a group broadcast needs) up to its Abort, so the next sync starts clean."""
        if isinstance(err, _AbortedByTrainer):
            self.channel.send(Aborted(self.name))
            return
        what = f"{type(err).__name__}: {err}"
        log.error("%s: the sync of weight version %d failed: %s", self.name, state.version, what)
        try:
            self.channel.send(Failed(self.name, f"the sync of weight version {state.version} failed: {what}"))
            if isinstance(err, SyncTimeout):
                return  # the trainer stopped answering: nothing more will come to read
            while True:
                message = self.channel.recv("reading the rest of a failed sync")
                if isinstance(message, Bucket) and self.receiver is not None:
                    self.receiver.acquire(message.layout)
                    self.receiver.release(message.layout)
                elif isinstance(message, Abort):
                    self.channel.send(Aborted(self.name))
                    return
        except SyncError as cleanup:
            log.error("%s: after a failed sync: %s", self.name, cleanup)
