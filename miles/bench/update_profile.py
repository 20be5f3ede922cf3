"""`miles bench train --profile N`: where one update's time goes, by kernel, by kind of work and by operator.

Three views of one profiled update:
- `kernels`: the N costliest device kernels (CUDA) by self time, with their calls;
- `classes`: every kernel's time summed by kind of work: `gemm` and `attention` (the FLOPs MFU counts),
  `optimizer` (AdamW's multi-tensor kernels), `copy` (casts, copies, cat, gather/scatter/index), `softmax`,
  `reduce` and `elementwise` (the memory-bound rest), `other`;
- `ops`: the N costliest aten operators by name, input shapes and caller, by the device time of the kernels
  each launched (CUDA) or by its own CPU time. The caller (`where`) is the first Python frame outside torch,
  or, for an operator that autograd's engine runs (no Python frame), the backward node that ran it
  (`SplitWithSizesBackward0`): together they name the code behind a copy or an add.
On CPU the kernels view is empty and `classes` sums the operators' own CPU time by the same kinds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# First match wins: grouped-GEMM kernel names also contain "elementwise"-free cutlass names, and flash
# attention's own kernels would otherwise read as GEMMs.
KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    (
        "gemm",
        re.compile(r"gemm|nvjet|xmma|cutlass|cublas|grouped_mm|_mm\b|\bmm\b|addmm|bmm|matmul|linear", re.I),
    ),
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("copy", re.compile(r"copy|cat|index|gather|scatter|embedding|_to_copy|clone|contiguous", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("reduce", re.compile(r"reduce|sum|norm|mean|max|min|cumsum", re.I)),
    (
        "elementwise",
        re.compile(r"elementwise|vectorized|unrolled|mul|add|sub|div|exp|log|silu|sigmoid", re.I),
    ),
)
CLASS_NAMES = tuple(name for name, _ in KERNEL_CLASSES) + ("other",)


def classify(name: str) -> str:
    """The kind of work a kernel (or, on CPU, an aten operator) named `name` does."""
    for kind, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return kind
    return "other"


def profile_update(step: Callable[[], None], top: int, device: torch.device) -> dict[str, Any]:
    """Run `step` (one update) under torch.profiler and return the three views (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step()
        if on_cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    ops = _op_rows(prof, on_cuda)
    classes = dict.fromkeys(CLASS_NAMES, 0.0)
    if on_cuda:
        for e in kernels:
            classes[classify(e.key)] += e.self_device_time_total / 1e3
    else:
        for row in ops:
            classes[classify(row["op"])] += row["ms"]
    return {
        "device_ms": sum(classes.values()),
        "classes": {k: v for k, v in classes.items() if v > 0},
        "kernels": [
            {"ms": e.self_device_time_total / 1e3, "calls": e.count, "name": e.key[:100]}
            for e in kernels[:top]
        ],
        "ops": ops[:top],
    }


def _op_rows(prof: Any, on_cuda: bool) -> list[dict[str, Any]]:
    """aten operators grouped by name, input shapes and caller, costliest first: device time of their own
    kernels (CUDA) or their own CPU time."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        us = e.self_device_time_total if on_cuda else e.self_cpu_time_total
        if us > 0:
            shapes = str([list(s) for s in (e.input_shapes or []) if s])[:120]
            total = totals.setdefault((e.name, shapes, caller(e)), [0.0, 0])
            total[0] += us
            total[1] += 1
    rows = [
        {"ms": us / 1e3, "calls": calls, "op": op, "shapes": shapes, "where": where}
        for (op, shapes, where), (us, calls) in totals.items()
    ]
    rows.sort(key=lambda r: -r["ms"])
    return rows


_REPO_ROOT = str(Path(__file__).resolve().parents[2]) + "/"


_PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")


def caller(event: Any) -> str:
    """Where a profiled operator was called from (`ops` in the module docstring); "" when unknown. The
    profiler records the Python stack as the operator's ancestors: frames named `file.py(line): function`."""
    event = event.cpu_parent
    while event is not None:
        name = event.name
        if _PYTHON_FRAME.search(name) and not (name.startswith("torch/") or "/torch/" in name):
            return name.replace(_REPO_ROOT, "").split("site-packages/", 1)[-1]
        if name.startswith("autograd::engine::evaluate_function: "):
            return name.split(": ", 1)[1]
        event = event.cpu_parent
    return ""


def print_profile(backend: str, view: dict[str, Any], on_cuda: bool) -> None:
    """The three views as markdown tables."""
    what = "kernels" if on_cuda else "operators' own CPU time"
    print(f"\n{backend}: {view['device_ms']:.1f} ms of {what} in one update, by kind")
    print("| kind | ms | share |\n|---|---|---|")
    total = view["device_ms"] or 1.0
    for kind, ms in sorted(view["classes"].items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {ms:.1f} | {ms / total:.1%} |")
    if view["kernels"]:
        print("\n| ms | calls | kernel |\n|---|---|---|")
        for k in view["kernels"]:
            print(f"| {k['ms']:.1f} | {k['calls']} | `{k['name']}` |")
    print("\n| ms | calls | operator | input shapes | where |\n|---|---|---|---|---|")
    for op in view["ops"]:
        print(f"| {op['ms']:.1f} | {op['calls']} | `{op['op']}` | {op['shapes']} | {op['where']} |")
