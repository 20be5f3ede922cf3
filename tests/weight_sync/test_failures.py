"""What goes wrong in a sync is caught and named: a corrupted bucket (the tensor, by the engine's check of
what it holds), a truncated one (the tensor), a weight version going backwards (refused, nothing loaded), a
receiver that stops answering (the engine, by name) and a trainer that does (on the engine's side).

The engine's side runs in a thread of this process here (`ThreadTarget`): the same code as in an engine
process, with short timeouts and faults injected where they are easy to reach."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing import Pipe
from typing import Any

import pytest
import torch

from miles.weight_sync import (
    Channel,
    SyncError,
    SyncRefused,
    SyncTimeout,
    TransportWeightSync,
    make_sender,
    trainer_stream,
)
from miles.weight_sync.buckets import BucketLayout
from miles.weight_sync.shared_buffers import ShmSender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import ThreadTarget, tiny_engine

BUCKET_MB = 8 / 1024
PROMPT = [[3, 14, 15, 92]]


def connected(transport: str, target: ThreadTarget, timeout_s: float = 10.0, **options: Any):
    sender = make_sender(transport, [target.channel], BUCKET_MB, timeout_s, **options)
    sender.connect()
    return sender


def corrupt_deliveries(target: ThreadTarget, name: str) -> None:
    """The engine's transport hands over a bucket with one byte of tensor `name` flipped (a copy: the
    sender's own fingerprint of the bucket stays that of what it packed)."""
    receiver = target.target.receiver
    acquire = receiver.acquire

    def corrupted(layout: BucketLayout) -> torch.Tensor:
        buffer = acquire(layout)
        slots = [s for s in layout.slots if s.name == name]
        if not slots:
            return buffer
        buffer = buffer.clone()
        buffer[slots[0].offset] ^= 1
        return buffer

    receiver.acquire = corrupted  # type: ignore[method-assign]


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
@pytest.mark.parametrize("name", ["model.norm.weight", "model.embed_tokens.weight"], ids=["whole", "pieces"])
def test_a_corrupted_bucket_is_named_by_the_engine_check(transport: str, name: str) -> None:
    engine = tiny_engine(moe=True)
    target = ThreadTarget(engine)
    sender = connected(transport, target, direct=False)  # buckets (direct mode: test_direct.py)
    try:
        corrupt_deliveries(target, name)
        result = TransportWeightSync(tiny_model(True, seed=3), sender).sync(version=1)
        assert not result.checksum_ok and result.mismatched == [name]
        assert result.metrics()["sync/checksum_ok"] == 0.0
    finally:
        sender.close()
        target.close()


class TruncatingSender(ShmSender):
    """Leaves out the last piece of one tensor larger than a bucket (or pretends a slot runs past the
    buffer's end)."""

    def __init__(self, *args: Any, drop: str = "", overrun: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop, self.overrun = drop, overrun

    def _publish(self, layout: BucketLayout) -> None:
        slots = []
        for slot in layout.slots:
            if slot.name == self.drop and slot.start + slot.numel == slot.total and slot.start > 0:
                continue
            if slot.name == self.overrun:
                slot = type(slot)(**{**slot.__dict__, "offset": self.bucket_bytes - 256, "numel": slot.numel})
            slots.append(slot)
        super()._publish(BucketLayout(layout.index, layout.buffer, tuple(slots)))


@pytest.mark.parametrize(
    "fault, message",
    [
        ({"drop": "lm_head.weight"}, "tensor 'lm_head.weight' is truncated"),
        (
            {"overrun": "model.layers.1.mlp.down_proj.weight"},
            "'model.layers.1.mlp.down_proj.weight'.*outside",
        ),
    ],
    ids=["missing_piece", "slot_past_the_end"],
)
def test_a_truncated_bucket_is_an_error_naming_the_tensor(fault: dict, message: str) -> None:
    engine = tiny_engine()
    target = ThreadTarget(engine)
    sender = TruncatingSender([target.channel], int(BUCKET_MB * 1024**2), 10.0, **fault)
    sender.connect()
    try:
        with pytest.raises(SyncError, match=message):
            sender.send(trainer_stream(tiny_model(seed=3)), version=1)
        # The engine refuses to generate from half-updated weights; a whole sync over the same connection
        # (the failed one was aborted cleanly on both sides) makes it whole again.
        with pytest.raises(RuntimeError, match="update_weights failed part-way"):
            engine.generate(PROMPT, engine_params())
        sender.drop = sender.overrun = ""
        good = sender.send(trainer_stream(tiny_model(seed=4)), version=1)
        assert good.checksum_ok and engine.weight_version == 1
        assert engine.generate(PROMPT, engine_params())[0].weight_version == 1
    finally:
        sender.close()
        target.close()


def engine_params():
    from miles.rollout import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buckets"])
def test_a_version_going_backwards_is_refused_and_loads_nothing(direct: bool) -> None:
    engine = tiny_engine()
    target = ThreadTarget(engine)
    sender = connected("shm", target, direct=direct)
    try:
        trainer = tiny_model(seed=3)
        first = TransportWeightSync(trainer, sender).sync(version=5)
        assert first.checksum_ok and first.path == ("direct" if direct else "buckets")
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        with pytest.raises(SyncRefused, match="refused weight version 3: it holds version 5"):
            TransportWeightSync(tiny_model(seed=4), sender).sync(version=3)
        assert engine.weight_version == 5
        assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
        # The same version again is a retry (the loop syncs again after a mismatch), not a step back.
        assert TransportWeightSync(trainer, sender).sync(version=5).checksum_ok
    finally:
        sender.close()
        target.close()


def test_a_receiver_that_never_answers_is_named() -> None:
    trainer_end, _engine_end = Pipe()  # nobody reads the other end
    sender = make_sender("shm", [Channel(trainer_end, "engine-7 (pid 4242)", 0.5)], BUCKET_MB, 0.5)
    started = time.monotonic()
    with pytest.raises(
        SyncTimeout, match=r"engine-7 \(pid 4242\) did not answer within 0\.\d s while connecting"
    ):
        sender.connect()
    assert time.monotonic() - started < 5


class StallingEngine:
    """An engine that stops for `stall_s` after its first received tensor (a hung receiver)."""

    def __init__(self, stall_s: float) -> None:
        self.engine, self.stall_s = tiny_engine(), stall_s
        self.model, self.device = self.engine.model, self.engine.device

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        def stalling() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(weights):
                if i == 1:
                    time.sleep(self.stall_s)
                yield item

        self.engine.update_weights(stalling(), version)


@pytest.mark.parametrize(
    "transport, direct",
    [("shm", True), ("shm", False), ("broadcast", False)],
    ids=["shm", "shm-buckets", "broadcast"],
)
def test_a_receiver_hung_in_the_middle_of_a_sync_times_out_naming_it(transport: str, direct: bool) -> None:
    target = ThreadTarget(StallingEngine(stall_s=3.0), name="engine-3", timeout_s=1.0)
    sender = connected(transport, target, timeout_s=1.0, direct=direct)
    started = time.monotonic()
    with pytest.raises(SyncTimeout, match="engine-3"):
        TransportWeightSync(tiny_model(seed=3), sender).sync(version=1)
    assert time.monotonic() - started < 3.0
    with pytest.raises(SyncError, match="broken.*engine-3"):
        TransportWeightSync(tiny_model(seed=3), sender).sync(version=2)
    sender.close()
    target.close()


def test_a_trainer_that_stops_in_the_middle_of_a_sync_is_named_on_the_engine_side() -> None:
    engine = tiny_engine()
    target = ThreadTarget(engine, timeout_s=0.5)  # the engine waits 0.5 s for the next bucket
    sender = connected("shm", target, timeout_s=10.0)

    def stalling_stream() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(trainer_stream(tiny_model(seed=3))):
            if i == 5:
                time.sleep(1.5)  # the trainer's conversion stalls
            yield item

    with pytest.raises(SyncError, match="the trainer did not answer within 0.5 s while waiting for bucket"):
        sender.send(stalling_stream(), version=1)
    target.close()
    assert len(target.errors) == 1 and isinstance(target.errors[0], SyncTimeout)
    assert "the trainer did not answer" in str(target.errors[0])
