"""The engine's side of direct syncs: the trainer's tensors as this engine opened them, views of the trainer's
own storages (shared memory, or CUDA allocations mapped by IPC handle), opened once per `Share` and read by
every later sync until the next one."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import torch

from miles.weight_sync.protocol import Share, SyncError


class DirectViews:
    def __init__(self) -> None:
        self.generation = 0
        """The trainer's Share these views are of (a Load names the one it copies from)."""
        self._views: dict[str, torch.Tensor] = {}
        """Name -> view, in the trainer's order."""

    def update(self, share: Share) -> None:
        """Open the Share's new tensors (torch's reductions map their storages: once per storage, cached),
        keep the views of the unchanged ones, drop those no longer shared (releasing the trainer's memory)."""
        opened: dict[str, torch.Tensor] = pickle.loads(share.tensors)
        missing = [name for name in share.names if name not in opened and name not in self._views]
        if missing:
            raise SyncError(
                f"share {share.generation} keeps {len(missing)} tensor(s) this engine never opened (first "
                f"{missing[0]!r}): the two sides disagree about what was shared; reconnect the transport"
            )
        self._views = {name: opened[name] if name in opened else self._views[name] for name in share.names}
        self.generation = share.generation

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view of the trainer's tensor), in the trainer's order."""
        yield from self._views.items()
