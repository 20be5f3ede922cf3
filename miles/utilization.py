"""How busy the compute device was during a step: `util/gpu_busy_frac` (CUDA) or `util/cpu_busy_frac` (CPU).

On a GPU, NVML's utilization counter is the percent of its last sample period (1/6 s to 1 s, by product) in
which at least one kernel ran. A background thread reads it every `interval_s` while the step runs, and the
step's value is the mean of those reads over 100. The counter belongs to the device, so another process's
kernels count too. It is read through `torch.cuda.utilization`, which needs `nvidia-ml-py` (the `gpu`
extra); without it the metric is left out, with one warning.

On the CPU the loop's own threads are the device: the process's CPU time over the step's wall time times the
intra-op threads torch runs with, at most the usable cores (reward worker processes are not counted).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class BusySampler:
    """Mean of `read()` (a percent) over the span between `start()` and `stop()`, as a fraction."""

    def __init__(self, read: Callable[[], float], interval_s: float = 0.1) -> None:
        self.read, self.interval_s = read, interval_s
        self._reads: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = False
        """A read raised: sampling stopped for good (the run goes on without the metric)."""

    def start(self) -> None:
        if self.failed:
            return
        self._reads = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="miles-busy-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        """The span's busy fraction in [0, 1], or None once a read has failed."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        if not self.failed and not self._reads:  # a span shorter than the interval: the counter's last period
            self._sample()
        if self.failed or not self._reads:
            return None
        return min(max(sum(self._reads) / len(self._reads) / 100.0, 0.0), 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._sample():
                return

    def _sample(self) -> bool:
        try:
            self._reads.append(float(self.read()))
            return True
        except Exception as err:  # NVML gone or failing: the metric goes, never the run
            self.failed = True
            log.warning("GPU utilization read failed (%s); util/gpu_busy_frac is no longer logged", err)
            return False


class CpuBusy:
    """The process's CPU time over wall time x intra-op threads, between `start()` and `stop()`."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._cpu, self._wall = time.process_time(), time.perf_counter()

    def stop(self) -> float | None:
        wall = time.perf_counter() - self._wall
        if wall <= 0:
            return None
        busy = (time.process_time() - self._cpu) / (wall * _compute_threads())
        return min(max(busy, 0.0), 1.0)


def _compute_threads() -> int:
    """Threads that can compute at once: torch's intra-op threads, at most the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores))


def nvml_reader(device: torch.device) -> Callable[[], float] | None:
    """A function reading `device`'s NVML utilization (percent), or None where there is none to read."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch.cuda.utilization(index)
    except Exception as err:  # no nvidia-ml-py, or NVML not loadable
        log.warning(
            "util/gpu_busy_frac is not logged: NVML cannot be read (%s); pip install nvidia-ml-py", err
        )
        return None
    return lambda: torch.cuda.utilization(index)


@dataclass
class BusyMeter:
    metric: str
    """`util/cpu_busy_frac` or `util/gpu_busy_frac`."""
    sampler: BusySampler | CpuBusy

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> float | None:
        return self.sampler.stop()


def busy_meter(device: torch.device | str) -> BusyMeter | None:
    """The busy meter of the loop's device; None on a GPU whose utilization cannot be read."""
    device = torch.device(device)
    if device.type == "cpu":
        return BusyMeter("util/cpu_busy_frac", CpuBusy())
    read = nvml_reader(device)
    return BusyMeter("util/gpu_busy_frac", BusySampler(read)) if read is not None else None
