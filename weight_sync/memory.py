"""A process's peak memory during a sync: the CUDA allocator's peak on a GPU, the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def start_peak(device: torch.device) -> None:
    """Resets the CUDA allocator's peak (only the benchmark asks: the loop's own memory metrics stay whole)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def read_peak(device: torch.device) -> tuple[int, str]:
    """(bytes, what they measure). On CPU the peak RSS of the whole process life: it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
