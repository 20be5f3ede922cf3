"""Flat buckets: how a stream of named tensors is laid out in fixed-size byte buffers, packed and unpacked.

One code path for every transport that moves bytes (`shm`, `cuda_ipc`, `broadcast`), so the CPU tests cover
the layout the GPU transports use. A bucket is a byte buffer of `bucket_bytes`; each tensor starts at an
`ALIGN`ed offset, in the wire dtype (the engine's, for floating-point tensors). A tensor larger than a bucket
is cut into pieces along its flattened elements, in order, each filling what is left of a bucket; the
receiving side puts the pieces back together (`Reassembly`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from miles.weight_sync.checksum import fingerprint_on_device
from miles.weight_sync.protocol import SyncError

ALIGN = 256
"""Bytes: every tensor starts at a multiple of it, so each view is aligned for any dtype and vector copy."""

MIN_BUCKET_BYTES = 4 * ALIGN


@dataclass(frozen=True)
class TensorSlot:
    """One tensor, or one piece of a tensor larger than a bucket, in a bucket."""

    name: str
    dtype: str
    """The wire dtype's name (`bfloat16`)."""
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offset: int
    """Bytes into the bucket."""
    start: int
    """Index of the piece's first element in the whole (flattened) tensor; 0 for a whole tensor."""
    numel: int
    """Elements in this bucket."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def total(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.total


@dataclass(frozen=True)
class BucketLayout:
    index: int
    """The bucket's place in this sync's sequence (0, 1, ...): a gap is a lost bucket."""
    buffer: int
    """Which buffer of the pool holds it."""
    slots: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        """Bytes used, up to the end of the last slot."""
        return max((s.offset + s.nbytes for s in self.slots), default=0)


@dataclass
class PlannedBucket:
    """A bucket's slots and the tensors (or flattened tensors, for pieces) they are packed from."""

    slots: list[TensorSlot] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return max((s.offset + s.nbytes for s in self.slots), default=0)


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def check_bucket_bytes(bucket_bytes: int) -> int:
    """`bucket_bytes` rounded down to a multiple of `ALIGN`; too small is an error that says what to do."""
    rounded = bucket_bytes // ALIGN * ALIGN
    if rounded < MIN_BUCKET_BYTES:
        raise ValueError(
            f"weight_sync bucket of {bucket_bytes} bytes is too small; use at least {MIN_BUCKET_BYTES} bytes "
            "(weight_sync.bucket_mb sets it in MiB; hundreds of MiB suit real models)"
        )
    return rounded


def wire_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype) -> torch.dtype:
    """Floating-point tensors travel in the engine's dtype (it would cast them anyway); others as they are."""
    return engine_dtype if tensor.is_floating_point() else tensor.dtype


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype_of: Callable[[torch.Tensor], torch.dtype],
) -> Iterator[PlannedBucket]:
    """The stream's buckets, planned lazily: a tensor is asked for only when the bucket before it is out, so
    a converting (gathering) stream holds one bucket of converted tensors at a time. A tensor that does not
    fit in what is left of the bucket starts the next one; one larger than a whole bucket is cut in pieces."""
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    bucket = PlannedBucket()
    used = 0
    for name, tensor in named:
        dtype = dtype_of(tensor)
        numel, item = tensor.numel(), dtype.itemsize
        oversized = numel * item > bucket_bytes
        if not oversized and bucket.slots and aligned(used) + numel * item > bucket_bytes:
            yield bucket
            bucket, used = PlannedBucket(), 0
        source = tensor.detach().reshape(-1) if oversized else tensor.detach()  # flattened once, not a piece
        start = 0
        while True:
            offset = aligned(used)
            room = (bucket_bytes - offset) // item
            if room <= 0:
                yield bucket
                bucket, used = PlannedBucket(), 0
                continue
            take = min(room, numel - start)
            slot = TensorSlot(
                name, str(dtype).removeprefix("torch."), tuple(tensor.shape), offset, start, take
            )
            bucket.slots.append(slot)
            bucket.sources.append(source)
            used = offset + take * item
            start += take
            if start >= numel:
                break
            yield bucket  # the piece filled it
            bucket, used = PlannedBucket(), 0
    if bucket.slots:
        yield bucket


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's elements in a flat uint8 `buffer`: the whole tensor's shape, or flat for a piece."""
    if slot.offset % ALIGN or slot.offset < 0 or slot.offset + slot.nbytes > buffer.numel():
        raise SyncError(
            f"bucket slot of {slot.name!r} ({slot.nbytes} bytes at offset {slot.offset}) lies outside the "
            f"{buffer.numel()}-byte buffer: the bucket is truncated or its layout corrupted"
        )
    flat = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.torch_dtype)
    return flat.view(slot.shape) if slot.whole else flat


def pack(buffer: torch.Tensor, bucket: PlannedBucket) -> None:
    """Copy (and cast) the bucket's tensors into `buffer`, on the current stream."""
    with torch.no_grad():
        for slot, source in zip(bucket.slots, bucket.sources):
            view = slot_view(buffer, slot)
            view.copy_(source if slot.whole else source[slot.start : slot.start + slot.numel])


def fingerprint_slots(buffer: torch.Tensor, slots: Iterable[TensorSlot]) -> list[tuple[str, torch.Tensor]]:
    """The fingerprints of what `buffer` holds in each slot (0-d device tensors, read by nobody yet; a
    piece's counts from its `start`, so a tensor's pieces sum to its fingerprint)."""
    return [(slot.name, fingerprint_on_device(slot_view(buffer, slot), first=slot.start)) for slot in slots]


def sum_fingerprints(prints: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Each name's fingerprint: its slots' summed (wrapping int64, as `fingerprint_on_device` sums its
    chunks), read from the device in one transfer."""
    if not prints:
        return {}
    values = torch.stack([value for _, value in prints]).tolist()
    totals: dict[str, int] = {}
    for (name, _), value in zip(prints, values):
        totals[name] = _wrap_int64(totals.get(name, 0) + value)
    return totals


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


Destination = Callable[[TensorSlot], torch.Tensor | None]
"""Where a piece of an oversized tensor may be written straight: the engine parameter that holds the whole
tensor (same dtype and shape, contiguous), flattened; None to reassemble it in a temporary."""


class Reassembly:
    """Puts the pieces of tensors larger than a bucket back together on the receiving side, in order.

    A piece goes straight into its destination when the engine holds the whole tensor as one contiguous
    parameter of its dtype (no temporary the size of a stacked-experts block), else into a temporary of the
    whole tensor, handed on when complete."""

    def __init__(self, device: torch.device, destination: Destination | None = None) -> None:
        self.device, self.destination = device, destination
        self._open: dict[str, tuple[TensorSlot, torch.Tensor, bool, int]] = {}
        """name -> (its first slot, the flat tensor being filled, whether that is the engine's own, elements
        received)."""

    def add(self, slot: TensorSlot, view: torch.Tensor) -> tuple[str, torch.Tensor, bool] | None:
        """Copy one piece in; returns (name, whole tensor, whether it already is in the engine) once the last
        piece arrived, else None."""
        entry = self._open.get(slot.name)
        if entry is None:
            if slot.start != 0:
                raise SyncError(
                    f"tensor {slot.name!r}: a piece starting at element {slot.start} arrived without the "
                    "pieces before it (a bucket was lost or reordered)"
                )
            target = self.destination(slot) if self.destination is not None else None
            in_place = target is not None
            if target is None:
                target = torch.empty(slot.total, dtype=slot.torch_dtype, device=self.device)
            entry = (slot, target, in_place, 0)
        first, target, in_place, received = entry
        if slot.start != received or slot.shape != first.shape or slot.dtype != first.dtype:
            raise SyncError(
                f"tensor {slot.name!r}: piece at element {slot.start} (shape {slot.shape}, {slot.dtype}) does not "
                f"continue the {received} elements received (shape {first.shape}, {first.dtype}); the stream "
                "is corrupted or a bucket was lost"
            )
        with torch.no_grad():
            target[slot.start : slot.start + slot.numel].copy_(view)
        received += slot.numel
        if received < slot.total:
            self._open[slot.name] = (first, target, in_place, received)
            return None
        self._open.pop(slot.name, None)
        return slot.name, target.view(slot.shape), in_place

    def check_complete(self) -> None:
        """At the end of a sync: a tensor still missing pieces was truncated."""
        if self._open:
            name, (first, _, _, received) = next(iter(self._open.items()))
            raise SyncError(
                f"tensor {name!r} is truncated: {received} of {first.total} elements arrived before the end of "
                f"the sync ({len(self._open)} tensor(s) incomplete)"
            )
