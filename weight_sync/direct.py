"""The trainer's side of a direct sync before any message goes out: which streams can skip the buckets (their
tensors' storages persist across syncs), which tensors changed since the engines last opened them, and the
fingerprints of what the engines will hold.

A direct sync shares the trainer's own parameters with the engines once; the optimizer updates them in
place, so every later sync only says "copy them now". A tensor is shared again when its memory changed (the
trainer replaced a parameter's `.data`, or the tensor set changed), detected by its address, shape, stride
and dtype; the shared tensors stay referenced here, so a replaced storage cannot be freed and its address
reused by another tensor while the engines' views still point at it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that pickle tensors as storage handles)

from miles.weight_sync.buckets import sum_fingerprints, wire_dtype
from miles.weight_sync.checksum import fingerprint_on_device
from miles.weight_sync.protocol import Share

NamedTensors = list[tuple[str, torch.Tensor]]

TensorKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
"""(address of the first element, shape, stride, dtype): the engine's view of a tensor is valid while it holds
(a tuple, not a dataclass: it is computed for every tensor of every sync)."""


def persistent_tensors(policy: torch.nn.Module) -> NamedTensors | None:
    """The policy's parameters as views of their own storages, which persist across syncs (the torch backend:
    its optimizer updates them in place); None where the stream is produced fresh each sync and must go
    through buckets: a policy with its own conversion (`iter_engine_weights`: the megatron backend converts
    and gathers), or a parameter that is not a plain dense tensor (a DTensor shard, sparse, meta)."""
    if getattr(policy, "iter_engine_weights", None) is not None:
        return None
    named: NamedTensors = []
    for name, param in policy.named_parameters():
        tensor = param.detach()
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_meta:
            return None
        named.append((name, tensor))
    return named


def tensor_key(tensor: torch.Tensor) -> TensorKey:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


@dataclass
class SharePlan:
    """The tensors new or moved since the engines' last Share, and every name of the sync in order."""

    generation: int
    names: list[str]
    tensors: dict[str, torch.Tensor]

    def message(self) -> Share:
        """The Share for ONE engine: pickled with torch's reductions (storage handles, offset, shape, stride,
        dtype) once per engine, since CUDA IPC counts its receivers and a shm file descriptor is handed out
        once. Unpickled by the engine's handler, so a handle it cannot open is an error it reports."""
        return Share(
            self.generation, self.names, bytes(ForkingPickler.dumps(self.tensors, pickle.HIGHEST_PROTOCOL))
        )


class SharedTensors:
    """What the engines hold views of, per name: its key and the tensor shared (kept referenced)."""

    def __init__(self) -> None:
        self.generation = 0
        """The last Share's (counted over the sender's life, so a reset never reuses one)."""
        self.names: list[str] = []
        self._held: dict[str, tuple[TensorKey, torch.Tensor]] = {}

    def update(
        self, named: Sequence[tuple[str, torch.Tensor]], prepare: Callable[[torch.Tensor], None]
    ) -> SharePlan | None:
        """The Share that brings the engines' views up to `named`, or None when they are current. Each tensor
        to share is `prepare`d first, which must leave its storage where sharing keeps it (shm: moved into
        shared memory, in place); its key is taken after. Recorded as shared at once: `reset()` if the
        engines fail to open it."""
        names = [name for name, _ in named]
        changed: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            held = self._held.get(name)
            if held is not None and held[0] == tensor_key(tensor):
                continue
            prepare(tensor)
            changed[name] = tensor
        if not changed and names == self.names:
            return None
        self._held = {
            name: (tensor_key(tensor), tensor) if name in changed else self._held[name]
            for name, tensor in named
        }
        self.names = names
        self.generation += 1
        return SharePlan(self.generation, names, changed)

    def reset(self) -> None:
        """The engines hold no view (a reconnect, a failed Share): the next sync shares every tensor."""
        self.names, self._held = [], {}


def wire_bytes(named: Sequence[tuple[str, torch.Tensor]], engine_dtype: torch.dtype) -> int:
    """Bytes the engines copy: each tensor in its wire dtype (the engine's, for floating-point tensors)."""
    return sum(t.numel() * wire_dtype(t, engine_dtype).itemsize for _, t in named)


def wire_fingerprints(named: Sequence[tuple[str, torch.Tensor]], engine_dtype: torch.dtype) -> dict[str, int]:
    """Each tensor's fingerprint as the engine should hold it (cast to the wire dtype, one tensor at a time),
    read from the device in one transfer."""
    prints = []
    for name, tensor in named:
        dtype = wire_dtype(tensor, engine_dtype)
        prints.append((name, fingerprint_on_device(tensor if tensor.dtype == dtype else tensor.to(dtype))))
    return sum_fingerprints(prints)
