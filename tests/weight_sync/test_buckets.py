"""The bucket layout every byte-moving transport shares (shm, cuda_ipc, broadcast): planning, packing,
unpacking, pieces of tensors larger than a bucket, and fingerprints that add up over pieces."""

from __future__ import annotations

import pytest
import torch

from miles.weight_sync import SyncError, tensor_fingerprint
from miles.weight_sync.buckets import (
    ALIGN,
    Reassembly,
    check_bucket_bytes,
    fingerprint_slots,
    pack,
    plan_buckets,
    slot_view,
    sum_fingerprints,
    wire_dtype,
)

BUCKET = 4096


def stream(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 5), "big": (40, 70), "b": (7,), "empty": (0, 4), "c": (30, 30), "tail": (1000,)}
    return [(name, torch.randn(shape, generator=g).to(dtype)) for name, shape in shapes.items()]


def unpacked(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Pack every planned bucket into one reused buffer and read it back as a receiver does."""
    buffer = torch.zeros(BUCKET, dtype=torch.uint8)
    reassembly = Reassembly(torch.device("cpu"))
    out: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(named, BUCKET, lambda t: wire_dtype(t, dtype)):
        assert bucket.nbytes <= BUCKET
        assert all(s.offset % ALIGN == 0 for s in bucket.slots)
        pack(buffer, bucket)
        for slot in bucket.slots:
            view = slot_view(buffer, slot)
            if slot.whole:
                out[slot.name] = view.clone()
            else:
                done = reassembly.add(slot, view)
                if done is not None:
                    out[done[0]] = done[1].clone()
    reassembly.check_complete()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_tensor_comes_back_bit_for_bit_in_the_wire_dtype(dtype: torch.dtype) -> None:
    named = stream()
    got = unpacked(named, dtype)
    assert list(got) == [n for n, _ in named]
    for name, tensor in named:
        assert got[name].dtype == dtype and torch.equal(got[name], tensor.to(dtype)), name


def test_only_tensors_larger_than_a_bucket_are_cut_and_order_is_kept() -> None:
    buckets = list(plan_buckets(stream(), BUCKET, lambda t: t.dtype))
    pieces = {}
    for bucket in buckets:
        for slot in bucket.slots:
            pieces.setdefault(slot.name, []).append((slot.start, slot.numel))
    assert len(pieces["big"]) == 3  # 11200 bytes over 4096-byte buckets
    assert [start for start, _ in pieces["big"]] == [
        0,
        pieces["big"][0][1],
        sum(n for _, n in pieces["big"][:2]),
    ]
    assert all(len(v) == 1 for k, v in pieces.items() if k != "big")  # c (3600 bytes) moved to a fresh bucket
    order = [s.name for b in buckets for s in b.slots]
    assert list(dict.fromkeys(order)) == ["a", "big", "b", "empty", "c", "tail"]


def test_the_stream_is_read_one_bucket_ahead_at_most() -> None:
    asked: list[str] = []

    def lazy():
        for name, tensor in stream():
            asked.append(name)
            yield name, tensor

    planner = plan_buckets(lazy(), BUCKET, lambda t: t.dtype)
    next(planner)
    assert asked == ["a", "big"]  # the first bucket is out as soon as "big" fills it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_fingerprints_of_pieces_add_up_to_the_whole(dtype: torch.dtype) -> None:
    whole = (torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 50).to(dtype)
    buffer = torch.zeros(BUCKET, dtype=torch.uint8)
    prints = []
    for bucket in plan_buckets([("w", whole)], BUCKET, lambda t: t.dtype):
        pack(buffer, bucket)
        prints += fingerprint_slots(buffer, bucket.slots)
    assert len(prints) > 1
    assert sum_fingerprints(prints) == {"w": tensor_fingerprint(whole)}


def test_bad_layouts_name_the_tensor() -> None:
    (bucket,) = plan_buckets([("x.weight", torch.ones(8))], BUCKET, lambda t: t.dtype)
    (slot,) = bucket.slots
    short = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(SyncError, match="'x.weight'.*outside the 16-byte buffer"):
        slot_view(short, slot)
    pieces = [
        s for b in plan_buckets([("big", torch.ones(3000))], BUCKET, lambda t: t.dtype) for s in b.slots
    ]
    buffer = torch.zeros(BUCKET, dtype=torch.uint8)
    reassembly = Reassembly(torch.device("cpu"))
    with pytest.raises(SyncError, match="'big': a piece starting at element 1024 arrived without"):
        reassembly.add(pieces[1], slot_view(buffer, pieces[1]))
    reassembly.add(pieces[0], slot_view(buffer, pieces[0]))
    with pytest.raises(SyncError, match="tensor 'big' is truncated: 1024 of 3000"):
        reassembly.check_complete()
    with pytest.raises(ValueError, match="too small"):
        check_bucket_bytes(100)


def test_a_piece_goes_straight_into_its_destination() -> None:
    target = torch.zeros(3000)
    pieces = [
        (s, b)
        for b in plan_buckets([("big", torch.arange(3000.0))], BUCKET, lambda t: t.dtype)
        for s in b.slots
    ]
    buffer = torch.zeros(BUCKET, dtype=torch.uint8)
    reassembly = Reassembly(torch.device("cpu"), destination=lambda slot: target)
    done = None
    for slot, _ in pieces:
        view = slot_view(buffer, slot)
        view.copy_(torch.arange(slot.start, slot.start + slot.numel, dtype=torch.float32))
        done = reassembly.add(slot, view)
    assert done is not None and done[2] and done[1].data_ptr() == target.data_ptr()
    assert torch.equal(target, torch.arange(3000.0))
