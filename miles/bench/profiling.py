"""`miles bench rollout`'s views inside a run: per-part step times (`--breakdown`), decode steps by batch
size against the roofline, the host's costliest functions (`--host-profile`) and torch.profiler's kernels
and device idle time (`--profile`)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

from miles.bench.common import decode_weight_bytes
from miles.models import ModelArgs
from miles.rollout import Engine
from miles.rollout.kv.pool import KVLayout


def add_breakdown(engine: Engine, totals: dict[str, float]) -> None:
    """Time the parts of each step (synchronising after the forward and the sampling to attribute GPU time)."""

    def timed(obj: Any, name: str, key: str, sync: bool) -> None:
        inner = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            return out

        setattr(obj, name, wrapper)

    sync = engine.device.type == "cuda"
    timed(engine.scheduler, "schedule", "schedule", False)
    timed(engine, "_build_batch", "build_batch", False)
    timed(engine.runner, "forward", "forward", sync)
    timed(engine.sampler, "sample", "sample", sync)
    timed(engine, "step", "step_total", False)


def record_decode_steps(engine: Engine, steps: list[tuple[int, int, float, float]]) -> None:
    """Append (batch, attended tokens, wall s, s the host waited for the device) of every pure decode step
    (steps that also prefill are left out, as from `decode_s`), read from the engine's counters."""
    inner = engine.step

    def step() -> list[Any]:
        st = engine.stats
        before = (st.decode_steps, st.decode_step_tokens, st.decode_kv_tokens, st.decode_s, st.device_wait_s)
        out = inner()
        if st.decode_steps > before[0]:
            steps.append(
                (
                    st.decode_step_tokens - before[1],
                    st.decode_kv_tokens - before[2],
                    st.decode_s - before[3],
                    st.device_wait_s - before[4],
                )
            )
        return out

    engine.step = step  # type: ignore[method-assign]


_BATCH_BINS = (1, 64, 128, 256, 384, 512, 640, 768, 1024, 1 << 30)


def decode_by_batch(
    steps: list[tuple[int, int, float, float]], args: ModelArgs, dtype: torch.dtype, bandwidth: float
) -> list[dict[str, float]]:
    """Decode steps grouped by batch size: ms per step against the bytes roofline at that batch and context.

    With overlap scheduling a step's wall time is the device's step time as long as the host keeps ahead,
    which `host_ms_per_step` (the step's wall time minus its wait for the device) shows: near the step time,
    the host sets the pace. So this says where in a run (which wave, which batch) the distance to the
    roofline is, and whether it is the host's, without a profiler."""
    kv_bytes = KVLayout.for_model(args, dtype, 1).bytes_per_token
    rows = []
    for lo, hi in zip(_BATCH_BINS, _BATCH_BINS[1:]):
        sel = [s for s in steps if lo <= s[0] < hi]
        if not sel:
            continue
        batch = sum(s[0] for s in sel) / len(sel)
        kv = sum(s[1] for s in sel) / len(sel)
        ms = 1e3 * sum(s[2] for s in sel) / len(sel)
        host_ms = ms - 1e3 * sum(s[3] for s in sel) / len(sel)
        # Per step, then averaged: the MoE experts a step touches grow less than linearly with its batch.
        roof_ms = 1e3 * sum(decode_weight_bytes(args, dtype, s[0]) + s[1] * kv_bytes for s in sel)
        roof_ms /= len(sel) * bandwidth
        rows.append(
            {
                "batch_lo": lo,
                "steps": len(sel),
                "avg_batch": batch,
                "avg_context": kv / batch,
                "ms_per_step": ms,
                "host_ms_per_step": host_ms,
                "roofline_ms_per_step": roof_ms,
                "pct_of_roofline": 100 * roof_ms / ms,
            }
        )
    return rows


def host_profile_top(prof: cProfile.Profile, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """The functions that took the most cumulative time, per engine step (from `--host-profile`)."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: -item[1][3])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})" if line else name,
            "cum_ms_per_step": 1e3 * cumulative / steps,
            "self_ms_per_step": 1e3 * own / steps,
            "calls_per_step": calls / steps,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


class StepProfiler:
    """torch.profiler over a window of engine steps (by default well into decode, after the prompts are in).

    `finish()` (called once the run is over, whatever happened) closes a window the run ended inside of,
    reporting the steps it did hold, and says so on stderr when the run never reached the window."""

    def __init__(self, engine: Engine, a: argparse.Namespace, report: dict[str, Any]) -> None:
        if a.profile_steps < 1 or a.profile_start < 0:
            raise SystemExit("miles bench rollout: --profile-steps must be >= 1 and --profile-start >= 0")
        Path(a.profile).mkdir(parents=True, exist_ok=True)  # a bad path fails now, not after the run
        self.engine, self.a, self.report = engine, a, report
        self.count = self.profiled = 0
        self.prof: Any = None
        self.started = 0.0
        inner = engine.step

        def step() -> list[Any]:
            if self.count == a.profile_start:
                self._open()
            try:
                return inner()
            finally:
                self.count += 1
                if self.prof is not None:
                    self.profiled += 1
                    if self.profiled == a.profile_steps:
                        self._close()

        engine.step = step  # type: ignore[method-assign]

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _open(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.engine.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._sync()  # the step in flight finishes first: the window holds its own steps' kernels only
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.started = time.perf_counter()

    def _close(self) -> None:
        self._sync()
        wall_ms = 1e3 * (time.perf_counter() - self.started) / self.profiled
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.report.update(
            profile_summary(prof, self.profiled),
            profile_wall_ms_per_step=wall_ms,
            profile_steps=self.profiled,
        )
        prof.export_chrome_trace(str(Path(self.a.profile) / "trace.json"))

    def finish(self, completed: bool) -> None:
        if self.prof is not None:
            self._close()
        if completed and self.count <= self.a.profile_start:
            print(
                f"miles bench rollout: the run took {self.count} engine steps, so the profile window "
                f"(--profile-start {self.a.profile_start}) was never reached; nothing was profiled",
                file=sys.stderr,
            )


def profile_summary(prof: Any, steps: int, top: int = 25) -> dict[str, Any]:
    """Per-step milliseconds of the most expensive device kernels (on CPU runs: of the CPU ops). Only kernels
    are counted on a device, so the eager ops outside CUDA graphs (the sampler) are not counted twice."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    on_device = any(getattr(e, "device_time_total", 0) for e in events)

    def cost(e: Any) -> float:
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    def counted(e: Any) -> bool:
        # A CPU op run outside a CUDA graph carries its kernels' device time as well: count only the kernels.
        return cost(e) > 0 and not (on_device and getattr(e, "device_type", None) == DeviceType.CPU)

    rows = sorted((e for e in events if counted(e)), key=cost, reverse=True)
    total_ms = sum(cost(e) for e in rows) / 1e3 / steps
    idle = device_idle(prof.events()) if on_device else None
    return {
        "profile_ms_per_step": total_ms,
        **(
            {
                "profile_device_busy_fraction": idle["busy_fraction"],
                "profile_short_gaps_per_step": idle["short_gaps"] / steps,
                "profile_short_gap_ms_per_step": idle["short_gaps_ms"] / steps,
                "profile_long_gap_ms_per_step": idle["long_gaps_ms"] / steps,
                "profile_longest_gaps": idle["longest_gaps"],
            }
            if idle is not None
            else {}
        ),
        "profile_top": [
            {"name": e.key[:120], "ms_per_step": cost(e) / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in rows[:top]
        ],
    }


SHORT_GAP_US = 20.0
"""Gaps shorter than this are kernel boundaries (one kernel draining, the next one starting, inside a CUDA
graph or a queue the host keeps full); longer ones are the device waiting for the host."""


def device_idle(events: Any, top: int = 8) -> dict[str, Any] | None:
    """Device idle time in the window (first kernel start to last kernel end): the share in which some kernel
    ran, the idle time in short gaps (kernel boundaries) and in long ones, and the longest gaps with the
    kernels on either side (launch gaps, host syncs)."""
    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        # GPU user annotations (e.g. around compiled regions) span several kernels and their gaps.
        if getattr(e, "device_type", None) == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return None
    busy, reach, before = 0.0, kernels[0][0], kernels[0][2]
    gaps = []
    for start, end, name in kernels:
        if start > reach:
            gaps.append((start - reach, before, name))
        if end > reach:
            busy += end - max(start, reach)
            reach, before = end, name
    gaps.sort(key=lambda g: g[0], reverse=True)
    short = [g[0] for g in gaps if g[0] < SHORT_GAP_US]
    return {
        "busy_fraction": busy / (reach - kernels[0][0]),
        "short_gaps": len(short),
        "short_gaps_ms": sum(short) / 1e3,
        "long_gaps_ms": (sum(g[0] for g in gaps) - sum(short)) / 1e3,
        "longest_gaps": [{"ms": us / 1e3, "after": a[:80], "before": b[:80]} for us, a, b in gaps[:top]],
    }
