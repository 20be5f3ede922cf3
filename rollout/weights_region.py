"""The engine model's weights at addresses that outlive their memory: `rollout.release_weights_during_train`.

Where the colocated engine holds a copy of its own (the megatron and deepspeed backends: the weight sync
writes every weight into it after each update), that copy sits idle while the trainer updates. Its
parameters are moved at engine start into reserved CUDA virtual address ranges (kv/virtual_memory.py, as the
KV pool's): `release()` gives their physical memory back to the device for the update, `restore()` maps new
memory at the same addresses before the sync, so the decode CUDA graphs captured over the weights replay as
captured. Until the sync wrote every parameter the weights are garbage and the engine refuses to run.
Buffers (rotary tables) are left alone: they are not synced and are small.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles.rollout.kv import virtual_memory
from miles.rollout.kv.virtual_memory import VirtualRegion

BUCKET_BYTES = 1 << 30
"""Parameters moved per region: the move holds at most one bucket twice (its old copy and its region)."""


def storage_span(tensor: torch.Tensor) -> int:
    """Elements a tensor's strides reach (its storage's extent from its first element)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def plan_buckets(
    named: Iterable[tuple[str, torch.nn.Parameter]], bucket_bytes: int
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The parameters in their order, grouped into runs of at most `bucket_bytes` (a larger one alone); a
    parameter reached under several names (tied embeddings) once, under its first."""
    buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
    seen: set[int] = set()
    size = 0
    for name, param in named:
        if id(param) in seen:
            continue
        seen.add(id(param))
        nbytes = storage_span(param) * param.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, param))
        size += nbytes
    return buckets


class WeightsRegion:
    """A model's parameters moved into reserved virtual memory (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES) -> None:
        named = list(model.named_parameters())
        device = named[0][1].device if named else torch.device("cpu")
        if not virtual_memory.supported(device):
            raise ValueError(
                f"rollout.release_weights_during_train needs a CUDA device whose driver has virtual memory "
                f"management; the engine's model is on {device}: set rollout.release_weights_during_train=false"
            )
        self.regions: list[VirtualRegion] = []
        self.names: list[str] = []
        self.nbytes = 0
        """Bytes of the parameters themselves (the regions round up to the driver's granularity)."""
        with torch.no_grad():
            for bucket in plan_buckets(named, bucket_bytes):
                self._move(bucket, device)
                torch.cuda.empty_cache()  # the old copies back to the driver, for the next region
        self.released = False
        self.unwritten: set[str] = set()
        """Parameters not written since the memory came back (their contents are the new memory's)."""

    def _move(self, bucket: list[tuple[str, torch.nn.Parameter]], device: torch.device) -> None:
        shapes = [(p.dtype, (storage_span(p),)) for _, p in bucket]
        region = VirtualRegion(VirtualRegion.bytes_for(shapes), device)
        for name, param in bucket:
            flat = region.carve(param.dtype, (storage_span(param),))
            view = flat.as_strided(param.shape, param.stride())  # the parameter's own layout
            view.copy_(param.data)
            param.data = view
            self.names.append(name)
            self.nbytes += param.numel() * param.element_size()
        self.regions.append(region)

    @property
    def mapped_bytes(self) -> int:
        """Device memory the regions hold now (outside torch's allocator)."""
        return sum(r.nbytes for r in self.regions if r.mapped)

    def release(self) -> None:
        """Give the weights' memory back; nothing may read or write them until `restore()`."""
        for region in self.regions:
            region.unmap()  # waits for the device's work on them first
        self.released = True

    def restore(self) -> None:
        """Memory at the same addresses again, its contents undefined until every parameter is written."""
        if not self.released:
            return
        torch.cuda.empty_cache()  # the update's cached blocks back to the driver, which maps from them
        try:
            for region in self.regions:
                region.map()  # a region mapped already is left as it is (a retry after an error)
        except torch.cuda.OutOfMemoryError as err:
            raise torch.cuda.OutOfMemoryError(
                f"the engine's weights ({self.nbytes / 1e9:.2f} GB) found no memory to come back to after the "
                f"update ({err}): what the update allocated still holds it. Lower rollout.kv_cache_fraction, or "
                "set trainer.offload_optimizer_during_rollout=true"
            ) from err
        self.released = False
        self.unwritten = set(self.names)

    def mark_written(self, names: Iterable[str]) -> None:
        self.unwritten.difference_update(names)

    def problem(self) -> str | None:
        """Why the engine cannot run on these weights now; None: it can."""
        if self.released:
            return (
                "the engine's weights are released for the update (rollout.release_weights_during_train); call "
                "engine.resume_weights() and write them with update_weights first"
            )
        if self.unwritten:
            first = sorted(self.unwritten)[:3]
            return (
                f"the engine's weights came back from a release without their values and {len(self.unwritten)} "
                f"parameter(s) are not written yet ({', '.join(first)}, ...): update_weights must write every "
                "parameter (the weight sync does)"
            )
        return None

    def check_writable(self) -> None:
        if self.released:
            raise RuntimeError(
                "update_weights while the engine's weights are released (no memory behind them): call "
                "engine.resume_weights() first"
            )
