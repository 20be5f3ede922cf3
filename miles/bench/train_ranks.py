"""`miles bench train --nproc N`: the ranks of a multi-process bench, started with the run's own launcher
(`miles.distributed.launch`: a file-store rendezvous, gloo on CPU, NCCL on GPUs), the trainer's start-up
checks of the sizes with this command's flags named, and each rank's peak memory gathered."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config import MilesConfig
from miles.distributed import DataParallel, check_devices, launch, world_from_env
from miles.distributed.launcher import LAUNCHED_ENV, exit_with_launcher
from miles.errors import MilesUserError
from miles.models import ModelArgs

_FLAGS = {
    "trainer.tensor_parallel_size": "--tensor-parallel-size",
    "trainer.expert_parallel_size": "--expert-parallel-size",
    "trainer.expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "trainer.backend=": "--backend ",
    "placement.num_processes": "--nproc",
    "model.device": "--device",
}
"""The config keys in the trainer's messages -> this command's flags."""


def as_flags(message: str) -> str:
    for key, flag in _FLAGS.items():
        message = message.replace(key, flag)
    return message


def check_sizes(a: argparse.Namespace, args: ModelArgs, backends: list[str]) -> None:
    """The trainer's start-up checks of the layout (config/validate.py, trainer/megatron/parallel.py), naming flags."""
    from miles.config.validate import check_expert_parallel_config
    from miles.trainer.backends import check_tensor_parallel

    if a.nproc < 1:
        raise MilesUserError(f"--nproc must be at least 1, got {a.nproc}")
    world = max(a.nproc, world_from_env())
    tp, ep, etp = a.tensor_parallel_size, a.expert_parallel_size, a.expert_tensor_parallel_size
    try:
        for backend in backends:
            cfg = MilesConfig()
            cfg.trainer.backend = backend
            cfg.trainer.tensor_parallel_size = tp
            cfg.trainer.expert_parallel_size = ep
            cfg.trainer.expert_tensor_parallel_size = etp
            cfg.placement.num_processes = world
            check_tensor_parallel(backend, tp)
            check_expert_parallel_config(cfg)
        if tp != 1 or ep != 1 or etp not in (None, 1):  # megatron only: the checks above refuse the others
            from miles.trainer.megatron.parallel import ParallelSizes, check_parallel_sizes
            from miles.trainer.megatron.policy import check_megatron_supports

            if not args.num_experts:  # a dense model's experts-TP is 1 whatever TP is, as MegatronPolicy's
                etp = etp or 1
            check_parallel_sizes(args, world, ParallelSizes(tp, ep, etp))
            check_megatron_supports(args, tp)
    except MilesUserError as err:
        raise MilesUserError(as_flags(str(err))) from None


def hide_gpus_from_cpu_ranks(a: argparse.Namespace) -> None:
    """CPU ranks see no GPU: megatron's collectives allocate on the current GPU in a process that has one
    (install_cpu_collectives in trainer/megatron/parallel.py). Runs before anything asks CUDA for its devices."""
    if a.device == "cpu" and (LAUNCHED_ENV in os.environ or world_from_env() > 1):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def launch_ranks(argv: list[str], a: argparse.Namespace) -> dict[str, Any]:
    """Start `a.nproc` ranks of this bench on this machine and return the report rank 0 wrote."""
    try:
        check_devices(a.nproc, a.device)
    except MilesUserError as err:
        raise MilesUserError(as_flags(str(err))) from None
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    with tempfile.TemporaryDirectory(prefix="miles-bench-train-") as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "miles.bench.train", *argv, "--report-to", str(report)]
        if a.device == "cpu":  # the ranks start without GPUs (see hide_gpus_from_cpu_ranks)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            code = launch(Path(folder), a.nproc, command=command)
        finally:
            if a.device == "cpu":
                if hidden is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        if code != 0:
            raise SystemExit(f"miles bench train: a rank exited with code {code} (its error is above)")
        return json.loads(report.read_text())


def largest_over_ranks(dp: DataParallel, device_bytes: int | None, host_bytes: int) -> dict[str, Any]:
    """Peak device and host memory: the largest rank's, and every rank's in rank order."""
    per_rank = dp.all_gather_objects((device_bytes, host_bytes))
    devices = [d for d, _ in per_rank]
    hosts = [h for _, h in per_rank]
    return {
        "peak_memory_bytes": None if None in devices else max(devices),
        "peak_memory_bytes_per_rank": devices,
        "peak_host_bytes": max(hosts),
        "peak_host_bytes_per_rank": hosts,
    }


def rank_entry(main: Callable[[list[str]], int]) -> int:
    """`python -m miles.bench.train`: a rank `launch` started (or torchrun's), its errors with flags named."""
    if LAUNCHED_ENV in os.environ:
        exit_with_launcher()
    try:
        return main(sys.argv[1:])
    except MilesUserError as err:
        rank = os.environ.get("RANK", "0")
        print(f"miles bench train (rank {rank}): error: {as_flags(str(err))}", file=sys.stderr)
        return 2
