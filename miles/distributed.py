"""Data parallelism for the embedded placement: N processes, each one device with its own engine and a
replica of the trainer, the gradients summed across them.

Every rank takes the same global prompt batch and generates the groups `batch[rank::world]`, so a group's
`n` samples stay on one engine (they share its radix cache) and a request draws what it would draw in one
process (its seed is its prompt's, not its rank's). The trainer sums gradients across ranks before each
optimizer step, so the replicas apply the same update and stay bit-identical; the loop checks that they do.

`DataParallel` is the one handle on the process group: code takes it as an argument (`SINGLE` when there
is one process) instead of asking torch.distributed globally.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from miles.errors import MilesUserError
from miles.sample import Sample

T = TypeVar("T")

_LAUNCHED_ENV = "MILES_LAUNCHED_BY"
"""Set in the processes `launch` starts, so they do not launch again."""
_STORE_ENV = "MILES_STORE_FILE"
"""The file the ranks of `launch` rendezvous in (no TCP port to pick)."""
_CONFIG_ENV = "MILES_CONFIG_FILE"
"""The resolved config the ranks of `launch` run, unredacted (the run folder's config.yaml may have its
secrets masked), in the launch's private store folder."""


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    on_cuda: bool = False
    """The ranks run on GPUs (one each, `cuda:local_rank`) and talk through NCCL; else gloo on CPU."""
    group: Any = None
    """The process group the collectives run in (None: the whole world); `rank` and `world_size` are within it."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share: every world_size-th item from position rank (whole items, in order)."""
        return list(items[self.rank :: self.world_size])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across ranks (`sum`, `max`, `min`); a no-op with one process."""
        if self.enabled:
            import torch.distributed as dist

            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=self.group)
        return tensor

    def all_reduce_floats(self, values: Sequence[float], op: str = "sum") -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        return self.all_reduce(tensor, op).tolist()

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._global_rank(0), group=self.group)
        return box[0]

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's copy of `module`."""
        if not self.enabled:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=self._global_rank(0), group=self.group)

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.on_cuda else torch.device("cpu")

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)

    def within(self, group: Any) -> DataParallel:
        """The same process in a subgroup of the world (its rank and size there)."""
        import torch.distributed as dist

        return replace(self, rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group)


SINGLE = DataParallel()


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_data_parallel(requested: int, device: str, timeout_s: float = 1800.0) -> DataParallel:
    """Join the process group torchrun (or `launch`) described in the environment; SINGLE for one process.

    `requested` is `placement.num_processes`: 1 accepts whatever world the launcher made.
    """
    world = world_from_env()
    if requested > 1 and world not in (1, requested):
        raise MilesUserError(
            f"placement.num_processes={requested} but the launcher started {world} processes; "
            "make them agree (or leave placement.num_processes=1 under torchrun)"
        )
    if world == 1:
        return SINGLE
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise MilesUserError(
                f"process {rank} needs GPU {local_rank} but {visible} are visible: start at most one process "
                "per GPU (placement.num_processes), or use model.device=cpu"
            )
        torch.cuda.set_device(local_rank)  # model.device=cuda / auto then resolves to this rank's GPU
    if not dist.is_initialized():
        store_file = os.environ.get(_STORE_ENV)  # set by `launch`; torchrun's env:// otherwise
        dist.init_process_group(
            backend="nccl" if on_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            **(
                {"init_method": f"file://{store_file}", "rank": rank, "world_size": world}
                if store_file
                else {}
            ),
        )
    return DataParallel(rank=rank, world_size=world, local_rank=local_rank, on_cuda=on_cuda)


def shutdown(dp: DataParallel) -> None:
    if dp.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def needs_launch(requested: int) -> bool:
    """True when `placement.num_processes` asks for processes nobody has started yet."""
    return requested > 1 and world_from_env() == 1 and _LAUNCHED_ENV not in os.environ


def check_devices(num_processes: int, device: str) -> None:
    """Fail before starting anything when the processes cannot each have a GPU of their own."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return
    if not torch.cuda.is_available():
        raise MilesUserError(f"model.device={device} but CUDA is not available; use model.device=cpu or auto")
    visible = torch.cuda.device_count()
    if num_processes > visible:
        raise MilesUserError(
            f"placement.num_processes={num_processes} needs one GPU per process and {visible} are visible; "
            f"use placement.num_processes={visible} (or model.device=cpu)"
        )


def launch(
    run_dir: Path,
    num_processes: int,
    poll_s: float = 0.2,
    command: list[str] | None = None,
    config_text: str | None = None,
) -> int:
    """Start `num_processes` ranks of the run whose resolved config is `config_text` (else
    `run_dir/config.yaml`) on this machine and wait for them. The ranks read it from a copy in the launch's
    private folder, so the run folder's config.yaml may have its secrets masked. If one fails, the others
    are stopped (a rank that died leaves the rest waiting in a collective), and so are they all if this
    process is interrupted or terminated. Returns the first non-zero exit code, or 0. (`command` replaces
    the rank's program, for tests.)"""
    # The ranks meet in a file store made fresh for this launch: a TCP port probed free here could be taken
    # by another program before rank 0 binds it. The folder names its launcher, so one a killed launcher
    # left behind is removed by the next.
    _remove_stale_stores(Path(tempfile.gettempdir()))
    store_dir = tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-")  # only this user may read it
    config_env: dict[str, str] = {}
    if config_text is None and (Path(run_dir) / "config.yaml").is_file():
        config_text = (Path(run_dir) / "config.yaml").read_text()
    if config_text is not None:
        config_file = os.path.join(store_dir, "config.yaml")
        with open(os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(config_text)
        config_env[_CONFIG_ENV] = config_file
    procs: list[subprocess.Popen[bytes]] = []

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # through the `finally` below, which stops the ranks

    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    code = 0
    try:
        for rank in range(num_processes):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(num_processes),
                "LOCAL_WORLD_SIZE": str(num_processes),
                _STORE_ENV: os.path.join(store_dir, "store"),
                _LAUNCHED_ENV: str(os.getpid()),
                **config_env,
            }
            cmd = command or [sys.executable, "-m", "miles.distributed", str(run_dir)]
            procs.append(subprocess.Popen(cmd, env=env))
        while True:
            codes = [p.poll() for p in procs]  # every rank, each round
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
    finally:
        _stop(procs)
        shutil.rmtree(store_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


_STORE_PREFIX = "miles-launch-"


def _remove_stale_stores(folder: Path) -> None:
    """Remove the store folders of launchers that are gone (killed with SIGKILL: no `finally` ran)."""
    for path in folder.glob(f"{_STORE_PREFIX}*-*"):
        pid = path.name[len(_STORE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM to the ranks still running, then SIGKILL to those that outlive `grace_s`; a second Ctrl-C
    while waiting goes straight to SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _exit_with_launcher() -> None:
    """In a rank `launch` started: end this process if the launcher is gone (killed with SIGKILL, say),
    instead of living on, orphaned, in a collective."""
    import threading

    launcher = int(os.environ[_LAUNCHED_ENV])

    def watch() -> None:
        while True:
            if os.getppid() != launcher:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="miles-launcher-watch", daemon=True).start()


# ---- metrics of a step, from every rank's to one set ----------------------------------------------------

_SUMMED_ENDINGS = (
    "errors",
    "timeouts",
    "/aborted",
    "/truncated",
    "restarts",
    "/dropped_samples",
    "/dropped_rows",
    "/preemptions",
    "/num_samples",
    "/num_groups",
    "/count",
    "tokens",
    "tokens_per_s",
    "bytes",
    "_steps",
    "_drafts",
)
"""Counts and rates: each rank's is its part of the whole, so they add (N engines make N times the tokens)."""

_LARGEST_ENDINGS = ("/max", "_peak", "_s", "seconds")
"""Maxima, peaks and durations (`rollout/decode_s`): the ranks run at the same time, so the step lasts the
longest rank's."""

_WEIGHTED_BY = {
    "rollout/prefix_hit_rate": "rollout/prompt_tokens",
    "rollout/spec_accept_length": "rollout/spec_steps",
    # means over samples, where a generate plugin's prompt may give several (`eval/count` counts prompts)
    "eval/reward_mean": "eval/num_samples",
    "eval/response_length": "eval/num_samples",
}
"""Means over something other than samples: each rank's weighs by its count of that."""


def combine_metrics(per_rank: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    """One metric set from each rank's, for the metrics a rank measures on its own share of the step:
    counts and rates add, maxima, peaks and durations (`time/*`, `*_s`) take the largest, `/min` the
    smallest, and every other value is a mean over the ranks weighted by `weights` (their numbers of
    samples), or by `P/count` for the keys under `P/` where the ranks report one (by `_WEIGHTED_BY`'s count
    for the keys it names); a `/std` is pooled with its `/mean`. A key some rank lacks is combined over the
    ranks that have it."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    keys = list(dict.fromkeys(k for metrics in per_rank for k in metrics))
    out: dict[str, float] = {}
    for key in keys:
        prefix = key.rsplit("/", 1)[0]
        have = [
            (float(m[key]), _weight(m, key, prefix, w), m)
            for m, w in zip(per_rank, weights)
            if m.get(key) is not None
        ]
        if not have:
            continue
        values = [v for v, _, _ in have]
        total = sum(w for _, w, _ in have)
        if key.endswith(_SUMMED_ENDINGS):
            out[key] = sum(values)
        elif key.endswith(_LARGEST_ENDINGS) or key.startswith("time/"):
            out[key] = _extreme(values, max)
        elif key.endswith("/min"):
            out[key] = _extreme(values, min)
        elif total <= 0:
            out[key] = sum(values) / len(values)
        else:
            # A rank with nothing to weigh (no samples) says nothing about a mean, whatever it reports (NaN).
            have = [h for h in have if h[1] != 0]
            if key.endswith("/std") and all(m.get(f"{prefix}/mean") is not None for _, _, m in have):
                mean = sum(float(m[f"{prefix}/mean"]) * w for _, w, m in have) / total
                second = sum((sd * sd + float(m[f"{prefix}/mean"]) ** 2) * w for sd, w, m in have) / total
                out[key] = math.sqrt(max(second - mean * mean, 0.0))
            else:
                out[key] = sum(v * w for v, w, _ in have) / total
    return out


def _extreme(values: list[float], pick: Callable[[list[float]], float]) -> float:
    """The largest or smallest value, NaN when any rank's is (Python's max and min keep or drop a NaN by
    its position, so a NaN on one rank would show or vanish with the ranks' order)."""
    return math.nan if any(math.isnan(v) for v in values) else pick(values)


def _weight(metrics: dict[str, float], key: str, prefix: str, default: float) -> float:
    count = metrics.get(_WEIGHTED_BY.get(key, f"{prefix}/count"))
    return default if count is None else float(count)


def reduce_metrics(dp: DataParallel, metrics: dict[str, float], weight: float) -> dict[str, float]:
    """`combine_metrics` over every rank's `metrics`, on every rank."""
    if not dp.enabled:
        return metrics
    gathered = dp.all_gather_objects((metrics, float(weight)))
    return combine_metrics([m for m, _ in gathered], [w for _, w in gathered])


def gather_samples(dp: DataParallel, samples: list[Sample]) -> tuple[list[Sample], int]:
    """Every rank's samples in rank order, and where this rank's begin in that list. With one process the
    list is `samples` itself; otherwise copies without the per-token logprobs and recorded routing (the
    batch-wide views, advantages and logs, do not read them)."""
    if not dp.enabled:
        return samples, 0
    slim = [replace(s, rollout_logprobs=[], routed_experts=None) for s in samples]
    parts = dp.all_gather_objects(slim)
    offset = sum(len(part) for part in parts[: dp.rank])
    return [s for part in parts for s in part], offset


def _worker_main(run_dir: str) -> int:
    """A process `launch` started: the run described by `run_dir/config.yaml`."""
    from omegaconf import OmegaConf

    from miles.config import MilesConfig
    from miles.run import run
    from miles.tracking import redact_logs

    _exit_with_launcher()
    redact_logs()
    folder = Path(run_dir)
    text = Path(os.environ.get(_CONFIG_ENV) or folder / "config.yaml").read_text()
    merged = OmegaConf.merge(OmegaConf.structured(MilesConfig), OmegaConf.create(text))
    config: MilesConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    try:
        run(config, folder, resolved_yaml=text)
    except MilesUserError as e:
        print(f"miles train (rank {os.environ.get('RANK')}): error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1]))
