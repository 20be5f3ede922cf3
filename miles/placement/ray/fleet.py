"""The engine actors behind the router, seen by the rollout side as one engine: `generate` splits the prompts
over the engines (router.py), runs them at once and returns the samples in the prompts' order.

An engine that dies or hangs during a call is restarted in its bundle, synced to the current weights by its
trainer rank, and given its prompts again. Only a finished call's samples are kept and a
prompt's draws depend on its own seed, so the resubmitted prompts give the samples they would have given,
and each (prompt, sample index) comes back once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from miles.distributed.metrics import combine_metrics
from miles.placement.engine_process import EngineProcess, EngineProcessError
from miles.placement.ray.router import Router
from miles.rollout import SamplingParams
from miles.sample import Sample

log = logging.getLogger("miles.placement")

PER_ENGINE_KEYS = ("rollout/tokens_per_s", "rollout/prefix_hit_rate")
"""Engine metrics logged per engine as well (`engine0/rollout/tokens_per_s`), beside the combined ones."""


class EngineFleet:
    def __init__(
        self,
        engines: list[EngineProcess],
        restart: Callable[[int], tuple[EngineProcess, Any]],
        max_restarts: int,
        multiturn: bool = False,
    ) -> None:
        """`engines`: running, synced; `restart(i)`: engine `i` anew (a new actor in its bundle) synced to
        the current weights, and that sync's result; `multiturn`: generate through the engines'
        `rollout.generate_fn` (a sample's whole session on one engine)."""
        self.engines, self._restart, self.max_restarts = engines, restart, max_restarts
        self.multiturn = multiturn
        self.router = Router(len(engines))
        self.device = torch.device(engines[0].info.device)
        self.samples = [0] * len(engines)
        """Samples each engine returned since the last `metrics()` (their metrics' weights)."""
        self.restarts = 0

    def generate(
        self,
        prompts: list[Sample],
        params: SamplingParams,
        on_finish: Callable[[Sample], None] | None = None,
    ) -> list[Sample]:
        """`len(prompts) * params.n` samples, prompt-major, as `Engine.generate` returns them."""
        max_new = params.max_new_tokens or 0
        pending = dict(enumerate(self.router.assign(prompts, params.n, max_new)))
        # Sent with their positions as group ids, so the samples (several per call from a multi-turn plugin)
        # find their prompt; the group ids are put back as they come.
        tagged = [replace(prompt, group_id=position) for position, prompt in enumerate(prompts)]
        drawn: list[list[Sample]] = [[] for _ in prompts]
        restarts = 0
        while pending:
            calls = {
                e: self.engines[e].submit([tagged[p] for p in positions], params, self.multiturn)
                for e, positions in pending.items()
                if positions
            }
            failed: dict[int, list[int]] = {}
            for e, request in calls.items():
                try:
                    samples = self.engines[e].result(request)
                except EngineProcessError as err:
                    if self.engines[e].alive:
                        raise  # the engine refused the call: a bad request, not a lost engine
                    log.warning("engine-%d was lost during a generate call (%s); restarting it", e, err)
                    failed[e] = pending[e]
                    continue
                for sample in samples:
                    position, sample.group_id = sample.group_id, prompts[sample.group_id].group_id
                    drawn[position].append(sample)
                self.samples[e] += len(samples)
                if on_finish is not None:
                    for sample in samples:
                        on_finish(sample)
            if failed:
                restarts += len(failed)
                if restarts > self.max_restarts:
                    raise EngineProcessError(
                        f"engines were lost {restarts} times in one generate call (placement."
                        f"max_engine_restarts={self.max_restarts}); see the engines' logs above"
                    )
                for e in failed:
                    self.restart(e)
            pending = failed
        return [sample for group in drawn for sample in group]

    def restart(self, e: int) -> Any:
        """Engine `e` again, in a new actor, synced to the current weights; returns that sync's result."""
        self.engines[e].close(timeout_s=1.0)
        self.engines[e], synced = self._restart(e)
        self.restarts += 1
        return synced

    def metrics(self) -> dict[str, float]:
        """Every engine's counters since the last call, combined (counts add, means weigh by samples), a
        few per engine too, and the router's."""
        per_engine = [engine.metrics(True) for engine in self.engines]
        out = combine_metrics(per_engine, [float(n) for n in self.samples])
        for e, metrics in enumerate(per_engine):
            out.update({f"engine{e}/{k}": metrics[k] for k in PER_ENGINE_KEYS if k in metrics})
        out.update(self.router.metrics())
        out["rollout/engine_restarts"] = float(self.restarts)
        self.samples, self.restarts = [0] * len(self.engines), 0
        return out

    def flush_cache(self) -> None:
        for engine in self.engines:
            engine.call("flush_cache")

    def release_memory(self) -> None:
        for engine in self.engines:
            engine.call("release_memory")

    def resume_memory(self) -> None:
        for engine in self.engines:
            engine.call("resume_memory")

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": [engine.call("state_dict") for engine in self.engines]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("ranks", [state])
        for engine, engine_state in zip(self.engines, saved):
            if engine_state:
                engine.call("load_state_dict", engine_state)

    def close(self) -> None:
        for engine in self.engines:
            try:
                engine.close(timeout_s=5.0)
            except Exception as err:
                log.info("closing %s: %s", engine.name, err)
