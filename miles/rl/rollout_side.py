"""The rollout side of an RL step: the engine (or a generate plugin driving it) draws the samples and the
rewards score them. The loop talks to it through `generate_scored`, `evaluate`, `metrics` and
`released_for_update`, whatever the placement behind it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from miles import plugins
from miles.config import MilesConfig
from miles.distributed import DataParallel, reduce_metrics
from miles.evaluate import evaluate
from miles.sample import Sample


class RolloutSide:
    def __init__(
        self,
        cfg: MilesConfig,
        engine: Any,
        rewards: Any,
        stop_token_ids: list[int],
        dp: DataParallel,
        plugin_here: bool = True,
    ) -> None:
        """`plugin_here`: a `rollout.generate_fn` plugin runs in this process, driving `engine` (False:
        the engines run it themselves, as Ray's engine actors do)."""
        from miles.rollout import MultiTurnRollout, SamplingParams

        self.engine, self.rewards, self.dp = engine, rewards, dp
        self.generate, self.multiturn = engine.generate, None
        if cfg.rollout.generate_fn and plugin_here:
            spec = plugins.normalize(cfg.rollout.generate_fn, "rollout.generate_fn")
            fn = plugins.load(spec, "rollout.generate_fn")
            self.multiturn = MultiTurnRollout(engine, fn, cfg.rollout.generate_timeout_s)
            self.generate = self.multiturn.generate
        self.params = SamplingParams.from_config(cfg.rollout, stop_token_ids=stop_token_ids)
        self.stop_token_ids, self.stop = stop_token_ids, list(cfg.rollout.stop)
        # Worker-pool graders start on each sample as it finishes, while the others still generate.
        self.score_early = cfg.reward.score_during_rollout and self.multiturn is None
        self.release_kv = cfg.rollout.release_kv_during_train and engine.device.type == "cuda"
        self.release_weights = cfg.rollout.release_weights_during_train  # checked at start: CUDA only
        self.eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens

    def generate_scored(
        self, prompts: list[Sample], seed: int, timings: dict[str, float]
    ) -> tuple[list[Sample], dict[str, float]]:
        """This rank's share of `prompts` (whole groups), generated and scored; adds to `time/rollout` and
        `time/reward` in `timings`."""
        self.params.seed = seed
        began = time.perf_counter()
        own = self.dp.shard(prompts)
        if self.score_early:
            drawn = self.engine.generate(own, self.params, on_finish=lambda s: self.rewards.score_early([s]))
        else:
            drawn = self.generate(own, self.params)
        timings["time/rollout"] += time.perf_counter() - began
        began = time.perf_counter()
        reward_metrics = self.rewards.score(drawn)
        timings["time/reward"] += time.perf_counter() - began
        return drawn, reward_metrics

    def evaluate(self, prompts: list[Sample]) -> dict[str, float]:
        """Greedy accuracy on this rank's share of the held-out prompts, combined over the ranks."""
        own = self.dp.shard(prompts)
        metrics, _ = evaluate(
            self.generate, self.rewards, own, self.eval_tokens, self.stop_token_ids, self.stop
        )
        # The next step starts as it would after a resume: from an empty radix cache (the eval's prompts
        # would change its bf16 prefill rounding on a GPU), and with counters that are its own.
        self.engine.flush_cache()
        self.engine.metrics()
        if self.multiturn is not None:
            metrics["eval/generate_errors"] = self.multiturn.metrics()["rollout/generate_errors"]
        return reduce_metrics(self.dp, metrics, metrics.get("eval/num_samples", len(own)))

    def metrics(self) -> dict[str, float]:
        """The engine's (and a generate plugin's) counters since the last call."""
        out = self.engine.metrics()
        if self.multiturn is not None:
            out.update(self.multiturn.metrics())
        return out

    @contextmanager
    def released_for_update(self, active: bool, timings: dict[str, float]) -> Iterator[None]:
        """With `rollout.release_kv_during_train` on a GPU the KV pool's memory (`time/kv_release`), and
        with `rollout.release_weights_during_train` the engine's own weights' (`time/weights_release`), go
        to the update; both come back after it, the weights empty until the weight sync that follows."""
        steps = []
        if active and self.release_kv:
            steps.append(("time/kv_release", self.engine.release_memory, self.engine.resume_memory))
        if active and self.release_weights:
            steps.append(("time/weights_release", self.engine.release_weights, self.engine.resume_weights))
        released = []
        try:
            for key, release, resume in steps:
                began = time.perf_counter()
                release()
                released.append((key, resume))
                timings[key] = time.perf_counter() - began
            yield
        finally:
            for key, resume in reversed(released):  # the weights first: the sync needs them next
                began = time.perf_counter()
                resume()
                timings[key] += time.perf_counter() - began

    def close(self) -> None:
        if self.multiturn is not None:
            self.multiturn.close()
        self.rewards.close()
