"""The trainer side of an RL step: the policy's update and, with `rollout.spec_draft_train`, the draft's
(a draft model or head) on the same rollouts, so the draft follows the policy it drafts for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from miles.config import MilesConfig
from miles.distributed import DataParallel
from miles.sample import Sample
from miles.trainer.offload import OptimizerOffload, PeakMemory


class TrainerSide:
    def __init__(self, trainer: Any, draft_trainer: Any = None, head: Any = None) -> None:
        self.trainer, self.draft_trainer, self.head = trainer, draft_trainer, head
        # The optimizer state off the GPU between updates, from before a colocated engine sizes its KV pool.
        self.offload = OptimizerOffload(trainer, trainer.cfg.offload_optimizer_during_rollout)
        self.offload.to_host()
        self.peak = PeakMemory(trainer.device, *_global_rank())
        self.outside_peak: Callable[[], int] = lambda: 0
        """The most device memory a colocated engine held outside torch's allocator since the last call
        (`Engine.outside_allocator_peak`: its reserved KV and weights regions), added to each phase's peak."""

    @classmethod
    def build(cls, cfg: MilesConfig, model: Any, trainer: Any, dp: DataParallel) -> tuple[TrainerSide, dict]:
        """The trainer side of `cfg`, and the draft the engine drafts with (`draft_model=` or `draft_head=`,
        the very module the draft trainer updates)."""
        if not cfg.rollout.spec_draft_train:
            return cls(trainer), {}
        if cfg.rollout.speculative == "head":
            from miles.rollout.spec.head import load_head
            from miles.trainer.draft.head_trainer import DraftHeadTrainer

            head = load_head(model, cfg.rollout)
            dp.broadcast_module(head)
            return cls(trainer, DraftHeadTrainer(head, model, cfg.trainer, cfg.rollout, dp), head), {
                "draft_head": head
            }
        from miles.rollout.spec.draft_model import load_draft_model
        from miles.trainer.draft.model_trainer import DraftTrainer

        draft = load_draft_model(model, cfg.rollout)
        dp.broadcast_module(draft)
        draft_trainer = DraftTrainer(
            draft, model.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm, dp
        )
        return cls(trainer, draft_trainer), {"draft_model": draft}

    def memory_reserve_bytes(self) -> int:
        """What the first update needs beside the engine's KV pool (colocated on one device)."""
        # Offloaded (trainer/offload.py): during rollout the policy holds its weights alone, and its update
        # takes the gradients and state in the memory the KV pool gives back (release_kv_during_train).
        reserve = 0 if self.offload.enabled else self.trainer.memory_reserve_bytes()
        if self.draft_trainer is not None:
            reserve += self.draft_trainer.memory_reserve_bytes()
        return reserve

    def train(
        self, rollouts: list[Sample], samples: list[Sample], update: bool, timings: dict[str, float]
    ) -> dict[str, float]:
        """The policy's update on `samples` (when `update`: every rank steps, with or without samples of
        its own) and the draft's on all of this rank's `rollouts` (`time/draft_train`)."""
        metrics: dict[str, float] = {}
        # since the last update: rollout, rewards, weight sync
        timings.update(self.peak.read("rollout", self.outside_peak()))
        offload_s = self.offload.to_device()
        if self.head is not None:  # from the hidden states of the policy that drew the samples
            self._train_draft(rollouts, metrics, timings)
        if update:
            metrics.update(self.trainer.train_step(samples))
        if self.draft_trainer is not None and self.head is None:
            self._train_draft(rollouts, metrics, timings)
        offload_s += self.offload.to_host()
        if self.trainer.cfg.offload_optimizer_during_rollout:  # 0 where there is no GPU to free
            timings["time/offload"] = offload_s
        timings.update(self.peak.read("update", self.outside_peak()))
        return metrics

    def _train_draft(
        self, rollouts: list[Sample], metrics: dict[str, float], timings: dict[str, float]
    ) -> None:
        began = time.perf_counter()
        metrics.update(self.draft_trainer.train_step(rollouts))
        timings["time/draft_train"] = time.perf_counter() - began


def _global_rank() -> tuple[int, int]:
    """(rank, number of processes) of this process in the run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
