"""Direct syncs (`shm`, the default mode): the engine copies straight from the trainer's parameters, shared
once, with no bucket pool. Bit for bit after the first sync and after an optimizer step updates them in
place (nothing shared again); a reallocated parameter or a new tensor set is shared again; a corrupted copy
is named; a trainer that stops between its Load and its End is named on the engine's side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from miles.placement.engine_process import EngineProcess
from miles.weight_sync import SyncError, TransportWeightSync, make_sender
from miles.weight_sync.direct import SharedTensors, persistent_tensors
from miles.weight_sync.direct_views import DirectViews
from tests.support.models import tiny_model
from tests.weight_sync.conftest import (
    TIMEOUT_S,
    ThreadTarget,
    assert_same_weights,
    exported,
    optimizer_step,
    tiny_engine,
)

BUCKET_MB = 8 / 1024


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_direct_shm_is_bit_exact_before_and_after_an_optimizer_step(
    moe: bool, engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    engine = engine_process(moe)
    trainer = tiny_model(moe, seed=30)
    count = len(list(trainer.parameters()))
    sender = make_sender("shm", [engine.sync_channel], BUCKET_MB, TIMEOUT_S)
    sender.connect()
    assert sender._pool == []  # direct mode allocates no bucket pool
    sync = TransportWeightSync(trainer, sender)
    try:
        for step in range(2):
            if step:
                before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
                optimizer_step(trainer, seed=step)
                assert all(not torch.equal(p, before[n]) for n, p in trainer.named_parameters())
            version = engine.weight_version + 1
            result = sync.sync(version)
            assert result.checksum_ok and not result.mismatched, result.mismatched
            assert result.path == "direct" and result.buckets == 0 and result.metrics()["sync/direct"] == 1.0
            assert result.shared == (count if step == 0 else 0)  # shared once; the step wrote in place
            assert result.bytes == sum(p.numel() * 4 for p in trainer.parameters())
            assert engine.weight_version == version
            assert_same_weights(exported(engine, tmp_path), trainer)
        assert sender._pool == []
    finally:
        sync.close()


def test_a_reallocated_parameter_or_a_new_tensor_set_is_shared_again(
    engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    engine = engine_process(False)
    trainer = tiny_model(seed=31)
    sender = make_sender("shm", [engine.sync_channel], BUCKET_MB, TIMEOUT_S)
    sender.connect()
    try:
        assert TransportWeightSync(trainer, sender).sync(engine.weight_version + 1).shared > 0
        norm = trainer.model.norm.weight
        norm.data = norm.data.clone() + 1  # a new storage: the engine's view is of the old one
        result = TransportWeightSync(trainer, sender).sync(engine.weight_version + 1)
        assert result.checksum_ok and result.path == "direct" and result.shared == 1
        assert_same_weights(exported(engine, tmp_path), trainer)

        other = tiny_model(seed=32)  # another policy object: every storage is new
        result = TransportWeightSync(other, sender).sync(engine.weight_version + 1)
        assert result.checksum_ok and result.shared == len(list(other.parameters()))
        assert_same_weights(exported(engine, tmp_path), other)

        # A bucketed sync on the same sender (a converting stream) opens the pool then (reconnecting); the
        # next direct sync shares everything again, as the reconnected engine dropped its views.
        named = ((n, p.detach()) for n, p in trainer.named_parameters())
        bucketed = sender.send(named, engine.weight_version + 1)
        assert bucketed.checksum_ok and bucketed.path == "buckets" and len(sender._pool) == 2
        result = TransportWeightSync(trainer, sender).sync(engine.weight_version + 1)
        assert (
            result.checksum_ok
            and result.path == "direct"
            and result.shared == len(list(trainer.parameters()))
        )
        assert_same_weights(exported(engine, tmp_path), trainer)
    finally:
        sender.close()


def test_the_engine_views_follow_each_share() -> None:
    """Unchanged tensors are not shared again, reallocated and new ones are, dropped names leave the views."""
    a, b, c = torch.zeros(3), torch.ones(2, 2), torch.full((4,), 2.0)
    shared, views = SharedTensors(), DirectViews()

    def share(named: list[tuple[str, torch.Tensor]]) -> int | None:
        plan = shared.update(named, lambda t: t.share_memory_())
        if plan is None:
            return None
        views.update(plan.message())
        assert [n for n, _ in views.tensors()] == [n for n, _ in named]
        assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views.tensors(), named))
        return len(plan.tensors)

    assert share([("a", a), ("b", b)]) == 2
    a.add_(5)  # in place: the view sees it, nothing to share
    assert share([("a", a), ("b", b)]) is None and torch.equal(dict(views.tensors())["a"], a)
    a = a.clone()
    assert share([("a", a), ("b", b)]) == 1
    assert share([("a", a), ("b", b), ("c", c)]) == 1
    assert share([("a", a), ("c", c)]) == 0  # b dropped
    assert share([("b", b.view(4)), ("c", c)]) == 1  # another shape of a storage already shared
    assert views.generation == shared.generation == 5


def test_only_parameters_of_a_policy_without_its_own_conversion_go_direct() -> None:
    model = tiny_model(seed=1)
    named = persistent_tensors(model)
    assert named is not None and [n for n, _ in named] == [n for n, _ in model.named_parameters()]

    class Converting(torch.nn.Module):
        def iter_engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ()

    assert persistent_tensors(Converting()) is None


@pytest.mark.parametrize(
    "name", ["model.norm.weight", "model.layers.0.mlp.experts.gate_up_proj"], ids=["dense", "experts"]
)
def test_a_corrupted_direct_copy_is_named_by_the_engine_check(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine copies one tensor with a bit flipped (a copy of the trainer's: the trainer's fingerprint
    stays that of what it holds): its check names it."""
    tensors = DirectViews.tensors

    def corrupted(self: DirectViews) -> Iterator[tuple[str, torch.Tensor]]:
        for key, view in tensors(self):
            if key == name:
                view = view.clone()
                view.view(-1).view(torch.uint8)[0] ^= 1
            yield key, view

    monkeypatch.setattr(DirectViews, "tensors", corrupted)
    target = ThreadTarget(tiny_engine(moe=True))
    sender = make_sender("shm", [target.channel], BUCKET_MB, 10.0)
    sender.connect()
    try:
        result = TransportWeightSync(tiny_model(True, seed=3), sender).sync(version=1)
        assert result.path == "direct" and not result.checksum_ok and result.mismatched == [name]
        assert result.metrics()["sync/checksum_ok"] == 0.0
    finally:
        sender.close()
        target.close()


def test_a_direct_sync_that_fails_part_way_is_aborted_and_the_next_one_is_whole() -> None:
    engine = tiny_engine()
    target = ThreadTarget(engine)
    sender = make_sender("shm", [target.channel], BUCKET_MB, 10.0)
    sender.connect()
    try:
        with pytest.raises(SyncError, match="has no place in this"):  # a MoE trainer, a dense engine
            TransportWeightSync(tiny_model(True, seed=3), sender).sync(version=1)
        with pytest.raises(RuntimeError, match="update_weights failed part-way"):
            engine.generate([[3, 14, 15]], _greedy())
        trainer = tiny_model(seed=4)
        result = TransportWeightSync(trainer, sender).sync(version=1)
        assert result.checksum_ok and result.path == "direct" and engine.weight_version == 1
        assert engine.generate([[3, 14, 15]], _greedy())[0].weight_version == 1
    finally:
        sender.close()
        target.close()


def _greedy():
    from miles.rollout import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=4)


def test_a_trainer_that_stops_before_its_end_is_named_on_the_engine_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from miles.weight_sync import direct_sender

    fingerprints = direct_sender.wire_fingerprints

    def stalling(*args: object) -> dict[str, int]:
        time.sleep(1.5)  # the trainer stops after its Load, before its End
        return fingerprints(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_sender, "wire_fingerprints", stalling)
    target = ThreadTarget(tiny_engine(), timeout_s=0.5)
    sender = make_sender("shm", [target.channel], BUCKET_MB, 10.0)
    sender.connect()
    with pytest.raises(SyncError, match="the trainer did not answer within 0.5 s while waiting for the end"):
        TransportWeightSync(tiny_model(seed=3), sender).sync(version=1)
    target.close()
    assert len(target.errors) == 1 and "the trainer did not answer" in str(target.errors[0])


def test_parameters_that_do_not_fit_in_dev_shm_go_through_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.weight_sync import shared_buffers

    monkeypatch.setattr(shared_buffers, "shm_free_bytes", lambda: 1024)  # a write past it would be a SIGBUS
    target = ThreadTarget(tiny_engine())
    sender = make_sender("shm", [target.channel], BUCKET_MB, 10.0)
    sender.connect()
    try:
        trainer = tiny_model(seed=3)
        result = TransportWeightSync(trainer, sender).sync(version=1)
        assert result.checksum_ok and result.path == "buckets" and result.buckets > 0
        assert not any(p.is_shared() for p in trainer.parameters())  # left where they were
    finally:
        sender.close()
        target.close()
