"""`RewardRunner`: scores a rollout batch with the configured rewards; nothing a reward does can crash the run.

Where a reward runs: user code (a file or module, sync or async) in the worker pool whatever reward.num_workers
says (0 then means USER_CODE_WORKERS workers for it), unless reward.in_process=true chooses the trainer's process;
sync built-ins in the pool with reward.num_workers > 0, else in this process; async built-ins (`remote`) on an
event-loop thread in this process; the `judge` built-in in this process (it drives an engine object). The pool gives
a hard kill on timeout, a memory cap, graders on a main thread, and no process a reward started outlives its call
(pool.py, worker.py). A call that raises, hangs past reward.timeout_s, returns NaN / a bad value, exits, crashes or
blows its memory cap scores 0 for its samples, is counted in reward/errors (and reward/timeouts), and the first
traceback of each kind is logged once (logger `miles.rewards`).

Combining: reward.weights {fn: weight} sums weighted components (a failed component contributes 0); the
kwargs of one component may be namespaced as reward.kwargs.<name>.<key>. reward.by_data_source {data_source: fn}
routes a sample (by sample.metadata["data_source"]) to one reward instead of the default ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from miles.config import RewardConfig
from miles.rewards.in_trainer import InProcessExecutor
from miles.rewards.loading import BUILTINS, RewardConfigError, RewardFunction, check_shared_kwargs, describe
from miles.rewards.outcome import RewardOutcome, failure
from miles.rewards.pool import WorkerPool
from miles.sample import Sample

log = logging.getLogger("miles.rewards")

LOCAL_TIMEOUTS_IN_A_ROW = 3
"""In-process sync calls (num_workers=0, the judge) run one after another and a timed-out thread cannot be
killed: after this many timeouts in a row of one reward in one batch, its other samples there fail at once
instead of costing `timeout_s` each (a reward stuck on every sample would cost N x timeout_s a step)."""
USER_CODE_WORKERS = 2
"""Workers started for user reward code when reward.num_workers=0 (the recipes' math config, sized for the
built-ins, which then stay in the trainer's process)."""
CHUNKS_PER_WORKER = 4
"""Per-sample rewards go to the pool in this many chunks per worker: few round trips, still balanced."""


def _to_plain(value: Any) -> Any:
    """Hydra DictConfig / ListConfig (at any depth) -> dict / list; other objects (an engine) pass through."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # omegaconf is a dependency; stay usable without it all the same
        pass
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def metric_names(specs: Sequence[str]) -> dict[str, str]:
    """reward/<name>/mean names: the built-in name or the function name, the whole spec when two would clash."""
    short = {s: s if s in BUILTINS else s.rsplit(":", 1)[-1] for s in specs}
    counts = Counter(short.values())
    return {s: short[s] if counts[short[s]] == 1 else re.sub(r"[^\w.-]+", "_", s).strip("_") for s in specs}


@dataclasses.dataclass
class _Component:
    fn: RewardFunction
    weight: float


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Population mean and std of finite floats, without overflow however large they are (each value is scaled
    before it is summed or squared); 0.0 for an empty list."""
    if not values:
        return 0.0, 0.0
    scale = max(1.0, max(abs(v) for v in values))
    scaled = [v / scale for v in values]
    mean = math.fsum(scaled) / len(scaled)
    variance = math.fsum((v - mean) ** 2 for v in scaled) / len(scaled)
    return mean * scale, math.sqrt(variance) * scale


def _slim(sample: Sample) -> Sample:
    """What a worker process receives: the sample without its per-token training arrays."""
    return dataclasses.replace(sample, rollout_logprobs=[], loss_mask=[], routed_experts=None)


def _shutdown(pool: WorkerPool | None, local: InProcessExecutor) -> None:
    if pool is not None:
        pool.close()
    local.close()


class RewardRunner:
    def __init__(self, cfg: RewardConfig, engine: Any = None) -> None:
        """engine: handed to the `judge` built-in when its kwargs name no engine / model_path (the embedded
        engine judging its own samples)."""
        self.timeout_s = float(cfg.timeout_s)
        if not self.timeout_s > 0:
            raise RewardConfigError(f"reward.timeout_s must be > 0, got {cfg.timeout_s}")
        num_workers = int(cfg.num_workers)
        if num_workers < 0:
            raise RewardConfigError(
                f"reward.num_workers must be >= 0 (0 scores in-process), got {num_workers}"
            )
        kwargs: dict[str, Any] = _to_plain(cfg.kwargs) or {}
        weights: dict[str, Any] = _to_plain(cfg.weights) or {}
        routes: dict[str, Any] = _to_plain(cfg.by_data_source) or {}
        if not weights and not cfg.fn:
            raise RewardConfigError(
                "set reward.fn (a built-in name, pkg.mod:func or file.py:func) or reward.weights"
            )
        default = weights or {cfg.fn: 1.0}
        for spec, weight in default.items():
            if not isinstance(weight, int | float) or weight != weight:
                raise RewardConfigError(f"reward.weights[{spec!r}] must be a number, got {weight!r}")
        specs = list(dict.fromkeys([*default, *routes.values()]))
        names = metric_names(specs)
        self.functions: dict[str, RewardFunction] = {}
        """Resolved rewards by their spec."""
        shared = {k: v for k, v in kwargs.items() if k not in names.values()}
        for spec in specs:
            name = names[spec]
            if len(specs) > 1 and name in kwargs and not isinstance(kwargs[name], dict):
                raise RewardConfigError(
                    f"reward.kwargs.{name} must be a mapping of {name!r}'s kwargs, got {kwargs[name]!r}"
                )
            own = kwargs.get(name) if isinstance(kwargs.get(name), dict) else {}
            if spec == "judge" and engine is not None and not {"engine", "model_path"} & {*own, *shared}:
                own = {**own, "engine": engine}
            if len(specs) == 1:
                self.functions[spec] = describe(spec, name, {**shared, **own}, bool(cfg.batched))
            else:
                self.functions[spec] = describe(spec, name, own, bool(cfg.batched), shared_kwargs=shared)
        if len(specs) > 1:
            check_shared_kwargs(shared, list(self.functions.values()))
        self._default = [_Component(self.functions[s], float(w)) for s, w in default.items()]
        self._routes = {str(ds): [_Component(self.functions[s], 1.0)] for ds, s in routes.items()}
        self._multi = len(specs) > 1

        self._user_in_process = bool(getattr(cfg, "in_process", False))
        self._configured_workers = num_workers
        self._num_workers = num_workers if num_workers > 0 else USER_CODE_WORKERS
        pool_functions = [f for f in self.functions.values() if self._wants_pool(f, num_workers)]
        self._pool = (
            WorkerPool(self._num_workers, int(cfg.worker_memory_mb), prebind=pool_functions)
            if pool_functions
            else None
        )
        self._explain_placement(num_workers)
        self._local = InProcessExecutor()
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._local)
        for fn in self.functions.values():
            if self._placement(fn) != "pool":
                try:
                    self._local.bind(fn)
                except RewardConfigError:
                    self.close()
                    raise
                except Exception as e:
                    self.close()
                    raise RewardConfigError(
                        f"building reward {fn.name!r} failed: {type(e).__name__}: {e}"
                    ) from e
        self._logged: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._early: dict[tuple[int, str], tuple[Sample, Future[list[RewardOutcome]], int]] = {}
        """(id(sample), reward name) -> (the sample, its pool call, its place in the call): `score_early`'s."""

    def _wants_pool(self, fn: RewardFunction, num_workers: int) -> bool:
        """User code runs in workers unless reward.in_process=true; sync built-ins when num_workers > 0; the
        judge (it drives an engine here) and async built-ins (`remote`, I/O on this process's loop) never."""
        if fn.in_process:
            return False
        if fn.user_code:
            return not self._user_in_process
        return not fn.is_async and num_workers > 0

    def _placement(self, fn: RewardFunction) -> str:
        if self._pool is not None and self._wants_pool(fn, self._configured_workers):
            return "pool"
        return "async" if fn.is_async else "local"

    def _explain_placement(self, num_workers: int) -> None:
        """Says where user code runs when the config could suggest otherwise (one line at start)."""
        user = [fn.name for fn in self.functions.values() if fn.user_code and not fn.in_process]
        if not user:
            return
        if self._user_in_process:
            log.warning(
                "reward.in_process=true: user reward(s) %s run in the trainer's process, with no memory cap and "
                "no hard kill: a crash, os._exit or fork there is the run's",
                user,
            )
        elif num_workers == 0:
            log.info(
                "user reward(s) %s run in %d worker processes (reward.timeout_s, reward.worker_memory_mb); "
                "reward.num_workers=0 keeps only the built-ins in the trainer (reward.in_process=true would run "
                "user code there too)",
                user,
                self._num_workers,
            )

    def score_early(self, samples: list[Sample]) -> None:
        """Start the worker-pool rewards of samples that finished generating while the rest of the batch still
        generates (the GPU then does not wait for the graders); the next `score` call waits for those results
        for the same sample objects instead of submitting them again, and forgets the rest (it holds the
        samples until then). In-process, async and batched rewards run in `score` as before."""
        if self._pool is None or self._closed or not samples:
            return
        with self._lock:
            groups: dict[str, list[Sample]] = defaultdict(list)
            by_name: dict[str, RewardFunction] = {}
            for sample in samples:
                for component in self._routes.get(sample.data_source, self._default):
                    fn = component.fn
                    if not fn.batched and self._placement(fn) == "pool":
                        groups[fn.name].append(sample)
                        by_name[fn.name] = fn
            for name, group in groups.items():
                future = self._pool.submit(by_name[name], [_slim(s) for s in group], self.timeout_s)
                for position, sample in enumerate(group):
                    self._early[(id(sample), name)] = (sample, future, position)

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Sets `reward` and `reward_info` on every sample in place and returns reward/* metrics."""
        if self._closed:
            raise RuntimeError("RewardRunner.score() called after close()")
        with self._lock:
            try:
                return self._score(samples)
            finally:
                self._early.clear()  # started for samples that never came here: nobody waits for them

    def _score(self, samples: list[Sample]) -> dict[str, float]:
        plans = [self._routes.get(s.data_source, self._default) for s in samples]
        members: dict[str, list[int]] = defaultdict(list)
        by_name: dict[str, RewardFunction] = {}
        for i, plan in enumerate(plans):
            for component in plan:
                members[component.fn.name].append(i)
                by_name[component.fn.name] = component.fn
        calls = []
        early: list[tuple[RewardFunction, int, Future[list[RewardOutcome]], int]] = []
        for name, indices in members.items():
            fn = by_name[name]
            if self._early and not fn.batched and self._placement(fn) == "pool":
                rest = []
                for i in indices:
                    started = self._early.get((id(samples[i]), name))
                    if started is not None and started[0] is samples[i]:
                        early.append((fn, i, started[1], started[2]))
                    else:
                        rest.append(i)
                indices = rest
                if not indices:
                    continue
            if fn.batched:
                calls.append((fn, indices))
            elif self._placement(fn) == "pool":  # chunks stream through the workers, timed per sample
                # An async reward's chunk runs concurrently in its worker: one chunk a worker, as wide as can be.
                per_worker = 1 if fn.is_async else CHUNKS_PER_WORKER
                size = -(-len(indices) // (per_worker * self._num_workers))
                calls += [(fn, indices[i : i + size]) for i in range(0, len(indices), size)]
            else:
                calls += [(fn, [i]) for i in indices]
        outcomes: dict[tuple[int, str], RewardOutcome] = {}

        def record(fn: RewardFunction, indices: list[int], results: list[RewardOutcome]) -> None:
            for i, outcome in zip(indices, results):
                outcomes[(i, fn.name)] = outcome

        pending = [
            (fn, indices, self._pool.submit(fn, [_slim(samples[i]) for i in indices], self.timeout_s))
            for fn, indices in calls
            if self._placement(fn) == "pool"
        ]
        timeouts_in_a_row: Counter[str] = Counter()
        for fn, indices in calls:
            if self._placement(fn) != "local":
                continue
            if timeouts_in_a_row[fn.name] >= LOCAL_TIMEOUTS_IN_A_ROW:
                message = (
                    f"not run: {fn.name} timed out on {LOCAL_TIMEOUTS_IN_A_ROW} samples in a row in this batch "
                    f"(reward.timeout_s={self.timeout_s:g}); in worker processes (reward.num_workers > 0, and "
                    "reward.in_process=false for user code) a stuck call is killed"
                )
                record(fn, indices, [failure("timeout", message)] * len(indices))
                continue
            results = self._local.run_sync(fn, [samples[i] for i in indices], self.timeout_s)
            timed_out = bool(results) and all(r.error_kind == "timeout" for r in results)
            timeouts_in_a_row[fn.name] = timeouts_in_a_row[fn.name] + 1 if timed_out else 0
            record(fn, indices, results)
        async_calls = [(fn, indices) for fn, indices in calls if self._placement(fn) == "async"]
        results = self._local.run_async(
            [(fn, [samples[i] for i in indices]) for fn, indices in async_calls], self.timeout_s
        )
        for (fn, indices), result in zip(async_calls, results):
            record(fn, indices, result)
        for fn, indices, future in pending:
            record(fn, indices, future.result())
        for fn, i, future, position in early:
            record(fn, [i], [future.result()[position]])
        metrics = self._apply(samples, plans, members, outcomes)
        if early:
            metrics["reward/early/num_samples"] = float(len({i for _, i, _, _ in early}))
        return metrics

    def _apply(
        self,
        samples: list[Sample],
        plans: list[list[_Component]],
        members: dict[str, list[int]],
        outcomes: dict[tuple[int, str], RewardOutcome],
    ) -> dict[str, float]:
        failed = timed_out = 0
        numeric: dict[str, list[float]] = defaultdict(list)  # a reward's numeric extra keys, for their means
        for i, (sample, plan) in enumerate(zip(samples, plans)):
            total, info, errors, kinds = 0.0, {}, [], []
            for component in plan:
                name, outcome = component.fn.name, outcomes[(i, component.fn.name)]
                total += component.weight * outcome.score
                extras = (
                    {f"{name}/{k}": v for k, v in outcome.extras.items()} if self._multi else outcome.extras
                )
                if self._multi:
                    info[name] = outcome.score
                info.update(extras)
                for key, value in extras.items():
                    if isinstance(value, int | float) and math.isfinite(value):  # (bools count as 0 / 1)
                        numeric[key].append(float(value))
                if outcome.failed:
                    errors.append(f"{name}: {outcome.error}" if self._multi else outcome.error)
                    kinds.append(outcome.error_kind)
                    self._log_once(component.fn, outcome)
            if not math.isfinite(total):  # huge weights times large scores: never a reward to train on
                errors.append(f"the weighted total {total} is not finite")
                kinds.append("bad_return")
                total = 0.0
            if errors:
                info["error"] = "; ".join(errors)
                info["error_kind"] = ",".join(dict.fromkeys(kinds))
                failed += 1
                timed_out += "timeout" in kinds
            sample.reward = float(total)
            sample.reward_info = info
        mean, std = _mean_std([s.reward for s in samples])
        metrics = {
            "reward/mean": mean,
            "reward/std": std,
            "reward/errors": float(failed),
            "reward/timeouts": float(timed_out),
        }
        for key, values in numeric.items():  # `P/count` weighs `P/mean` across data-parallel ranks
            metrics[f"reward/info/{key}/mean"] = sum(values) / len(values)
            metrics[f"reward/info/{key}/count"] = float(len(values))
        if self._multi:
            for name, indices in members.items():
                scored = [outcomes[(i, name)] for i in indices]
                metrics[f"reward/{name}/mean"] = _mean_std([o.score for o in scored])[0]
                metrics[f"reward/{name}/count"] = float(len(scored))
                metrics[f"reward/{name}/errors"] = float(sum(o.failed for o in scored))
        if self._pool is not None:
            metrics["reward/worker_restarts"] = float(self._pool.restarts)
        return metrics

    def _log_once(self, fn: RewardFunction, outcome: RewardOutcome) -> None:
        kind = outcome.error_kind or ""
        detail = (outcome.error or "").split(":", 1)[0] if kind == "exception" else ""
        key = (fn.name, kind, detail)
        if key in self._logged:
            return
        self._logged.add(key)
        counters = "reward/errors and reward/timeouts" if kind == "timeout" else "reward/errors"
        log.warning(
            "reward %r failed (%s): %s. The sample scores 0 and is counted in %s; later failures of this kind are "
            "counted, not logged.%s",
            fn.name,
            kind,
            outcome.error,
            counters,
            f"\n{outcome.traceback.rstrip()}" if outcome.traceback else "",
        )

    def close(self) -> None:
        """Cancels calls in flight and stops the workers; safe to call twice."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
