"""The colocated memory plan: the optimizer's state off the GPU while the engine generates, and the peak memory
of each phase.

`trainer.offload_optimizer_during_rollout` moves the float32 master weights and AdamW moments (the replicated
AdamW's or the distributed optimizer's shards) into pinned CPU buffers after each update and back before the
next: `time/offload` is the time both moves took in the step. The first move happens when the trainer side is
built, before a colocated engine sizes its KV pool, and the trainer then reserves nothing beside the pool:
during rollout the policy holds its weights alone, and the update takes its gradients and state in the memory
the pool gives back (`rollout.release_kv_during_train=true`, checked at start). The state's tensors keep their identity (their
`.data` moves), so the optimizer, checkpoints and the master-weight hooks see them wherever they are.

On a machine without CUDA the state already lives in host memory: offloading is a no-op that reports
`time/offload` 0, so a CPU run of a GPU recipe behaves the same.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from miles.errors import MilesUserError

GB = 1e9


def check_memory_plan(config: Any) -> None:
    """Combinations of `trainer.distributed_optimizer` / `offload_optimizer_during_rollout` that cannot run."""
    trainer, rollout = config.trainer, config.rollout
    if trainer.distributed_optimizer:
        if trainer.backend == "deepspeed":
            raise MilesUserError(
                "trainer.distributed_optimizer is the torch/megatron backends' sharded AdamW; DeepSpeed shards "
                "its own (trainer.backend=deepspeed): set trainer.distributed_optimizer=false"
            )
        if config.placement.mode == "ray":
            raise MilesUserError(
                "trainer.distributed_optimizer writes its checkpoint shards from every rank, which "
                "placement.mode=ray does not do yet: use the embedded placement (torchrun / "
                "placement.num_processes) or trainer.distributed_optimizer=false"
            )
    if trainer.offload_optimizer_during_rollout:
        if trainer.backend == "deepspeed":
            raise MilesUserError(
                "trainer.offload_optimizer_during_rollout moves the torch/megatron backends' optimizer state; "
                "with trainer.backend=deepspeed use DeepSpeed's own offload"
            )
        if config.placement.mode == "ray":
            raise MilesUserError(
                "trainer.offload_optimizer_during_rollout runs in the embedded placement's loop; with "
                "placement.mode=ray set it to false"
            )
        if not rollout.release_kv_during_train:
            raise MilesUserError(
                "trainer.offload_optimizer_during_rollout lends the optimizer's memory to the KV pool during "
                "rollout, which must give it back for the update: set rollout.release_kv_during_train=true"
            )


class OptimizerOffload:
    """Moves a PolicyTrainer's optimizer state between the device and pinned host buffers."""

    def __init__(self, trainer: Any, enabled: bool) -> None:
        self.trainer = trainer
        self.enabled = enabled and trainer.device.type == "cuda"
        self.on_host = False
        self._host: dict[int, torch.Tensor] = {}
        """Pinned buffers by tensor id, allocated once and reused by every move."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The float32 masters and the moments (not the weights the engine samples from)."""
        trainer = self.trainer
        if trainer.sharded is not None:
            return [t for _, _, t in trainer.sharded.shard_tensors()]
        tensors = []
        if trainer.masters is not None:
            tensors += [m for p, m in zip(trainer.masters.params, trainer.masters.masters) if m is not p]
        # the fused kernel keeps its step counts on the device too (a resume loads them beside the masters)
        fused = any(g.get("fused") for g in trainer.optimizer.param_groups)
        for state in trainer.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and (v.dim() > 0 or fused)]
        return tensors

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def to_host(self) -> float:
        """Seconds the move took (0 when off, or the state is there already)."""
        if not self.enabled or self.on_host:
            return 0.0
        began = time.perf_counter()
        moved = []
        for tensor in self.state_tensors():
            if tensor.device.type != "cuda":
                continue
            host = self._host.get(id(tensor))
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host[id(tensor)] = host
            host.copy_(tensor, non_blocking=True)
            moved.append((tensor, host))
        torch.cuda.synchronize()
        for tensor, host in moved:
            tensor.data = host
        self.on_host = True
        return time.perf_counter() - began

    def to_device(self) -> float:
        if not self.enabled or not self.on_host:
            return 0.0
        began = time.perf_counter()
        device = self.trainer.device
        for tensor in self.state_tensors():
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.to(device, non_blocking=True)
        torch.cuda.synchronize()
        self.on_host = False
        return time.perf_counter() - began


class PeakMemory:
    """Per-rank device memory peaks of the phase since the last reading (`memory/peak_<phase>_gb`; also
    `memory/rank<R>/peak_<phase>_gb` with several processes). Nothing without CUDA."""

    def __init__(self, device: torch.device, rank: int, ranks: int) -> None:
        self.enabled = device.type == "cuda"
        self.device, self.rank, self.ranks = device, rank, ranks

    def read(self, phase: str, outside_bytes: int = 0) -> dict[str, float]:
        """The phase's peak, and the counter restarted for the next phase. `outside_bytes`: the most device
        memory held outside torch's allocator in the phase (a colocated engine's reserved regions)."""
        if not self.enabled:
            return {}
        peak = (torch.cuda.max_memory_allocated(self.device) + outside_bytes) / GB
        torch.cuda.reset_peak_memory_stats(self.device)
        metrics = {f"memory/peak_{phase}_gb": peak}
        if self.ranks > 1:
            metrics[f"memory/rank{self.rank}/peak_{phase}_gb"] = peak
        return metrics
