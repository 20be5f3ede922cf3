"""The device-busy meters behind util/gpu_busy_frac and util/cpu_busy_frac."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from miles import utilization
from miles.utilization import BusySampler, CpuBusy, busy_meter


def test_sampler_reports_the_mean_of_its_reads_as_a_fraction() -> None:
    values = itertools.cycle([20.0, 60.0])
    reads: list[float] = []
    lock = threading.Lock()

    def read() -> float:
        with lock:
            reads.append(next(values))
            return reads[-1]

    sampler = BusySampler(read, interval_s=0.005)
    sampler.start()
    time.sleep(0.1)
    busy = sampler.stop()
    assert len(reads) >= 2
    assert busy == pytest.approx(sum(reads) / len(reads) / 100.0)
    count = len(reads)
    time.sleep(0.02)
    assert len(reads) == count, "the thread kept reading after stop()"


def test_a_span_shorter_than_the_interval_reads_once() -> None:
    sampler = BusySampler(lambda: 42.0, interval_s=60.0)
    sampler.start()
    assert sampler.stop() == pytest.approx(0.42)
    assert BusySampler(lambda: 1.0).stop() is None  # never started


def test_a_failing_read_drops_the_metric_not_the_run() -> None:
    calls = itertools.count()

    def read() -> float:
        if next(calls) >= 1:
            raise RuntimeError("NVML: GPU is lost")
        return 50.0

    sampler = BusySampler(read, interval_s=0.005)
    sampler.start()
    time.sleep(0.05)
    assert sampler.stop() is None and sampler.failed
    sampler.start()  # later steps: no thread, no metric
    assert sampler.stop() is None


def test_cpu_meter_counts_compute_and_not_sleep() -> None:
    meter = CpuBusy()
    meter.start()
    time.sleep(0.2)
    idle = meter.stop()
    meter.start()
    end = time.perf_counter() + 0.2
    x = torch.ones(64, 64)
    while time.perf_counter() < end:
        x = (x @ x).clamp(max=1.0)
    busy = meter.stop()
    assert idle is not None and busy is not None
    assert idle < 0.3 < busy <= 1.0, (idle, busy)


def test_meter_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = busy_meter("cpu")
    assert busy is not None
    name, meter = busy.metric, busy.sampler
    assert name == "util/cpu_busy_frac" and isinstance(meter, CpuBusy)

    def no_nvml(index: int | None = None) -> int:
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    # A GPU whose NVML cannot be read: no meter (and a warning), the run goes on.
    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert busy_meter("cuda") is None
    monkeypatch.setattr(torch.cuda, "utilization", lambda index=None: 37)
    busy = busy_meter("cuda:0")
    assert busy is not None
    name, meter = busy.metric, busy.sampler
    assert name == "util/gpu_busy_frac" and isinstance(meter, BusySampler)
    assert utilization.nvml_reader(torch.device("cuda:0"))() == 37  # type: ignore[misc]
