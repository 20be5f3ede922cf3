"""The loop's weight sync to engines in other processes: `TransportWeightSync(policy, sender).sync(version)`,
called as `InProcessWeightSync.sync` is.

The trainer's weights go as a stream in the engine's names: the policy's `iter_engine_weights()` where it
has its own model definition (the megatron backend converts, and with tensor parallelism gathers, one tensor
at a time), else its parameters. The sender buckets the stream as it comes, so a sharded trainer never holds
more than a bucket of gathered tensors and never the whole model. Every rank of a sharded trainer runs the
stream (its gathers are collectives of the TP group); only the sending rank has a sender.

Parameters that persist across syncs (the torch backend's, updated in place) skip the buckets where the
sender can share them (`shm`, `cuda_ipc` in direct mode, the default): the engines copy straight from them
(direct_sender.py); the result's `path` says which way a sync went.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from miles.weight_sync.direct import persistent_tensors
from miles.weight_sync.direct_sender import DirectSender
from miles.weight_sync.result import TransportSyncResult
from miles.weight_sync.sender import WeightSender


def trainer_stream(policy: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The policy's weights in the engine's names, one tensor at a time."""
    export = getattr(policy, "iter_engine_weights", None)
    if export is not None:
        return export()
    return ((name, param.detach()) for name, param in policy.named_parameters())


class TransportWeightSync:
    def __init__(
        self,
        policy: torch.nn.Module,
        sender: WeightSender | None,
        verify: bool = True,
        measure_memory: bool = False,
        transport: str = "",
    ) -> None:
        """`sender`: a connected sender on the trainer's sending rank; None on a rank that only takes part in
        the stream's gathers (tensor parallelism), whose result says `sent` False. `transport`: its name on
        such a rank (for the result)."""
        self.policy, self.sender = policy, sender
        self.verify, self.measure_memory = verify, measure_memory
        self.transport = sender.transport if sender is not None else transport or "broadcast"

    @torch.no_grad()
    def sync(self, version: int) -> TransportSyncResult:
        sender = self.sender
        if isinstance(sender, DirectSender) and sender.direct:
            named = persistent_tensors(self.policy)
            if named is not None and sender.takes_direct(named):
                return sender.send_direct(named, version, self.verify, self.measure_memory)
        if sender is not None:
            return sender.send(trainer_stream(self.policy), version, self.verify, self.measure_memory)
        started = time.perf_counter()
        for _ in trainer_stream(self.policy):  # the TP group's gathers, which every rank must run
            pass
        return TransportSyncResult(
            version, time.perf_counter() - started, 0, True, [], transport=self.transport, sent=False
        )

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
