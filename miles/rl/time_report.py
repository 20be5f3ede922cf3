"""Where a run's time went: the step records' `time/*` phases summed, printed when `miles train` ends.

The phases are the ones each step measures (generation, grading, the update, the weight sync, eval, a draft's
update); what a step spends outside them (host work between phases, logging, checkpoints) is `other`. With
`trainer.async_rollout=one_step` the next rollout runs during the update, so the phases can sum to more than
the wall time; `other` is then 0 and the overlap is shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("rollout", "reward", "train", "draft_train", "sync", "eval")
BUSY_KEYS = ("util/gpu_busy_frac", "util/cpu_busy_frac")


@dataclass
class TimeReport:
    steps: int = 0
    step_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    busy_key: str | None = None
    busy_weighted: float = 0.0
    """Sum of each step's busy fraction times its seconds (a time-weighted mean over the run)."""
    busy_seconds: float = 0.0

    def add(self, record: dict[str, float]) -> None:
        """One step's record (its `time/*` and `util/*_busy_frac` keys; any others are ignored)."""
        seconds = float(record.get("time/step", 0.0))
        self.steps += 1
        self.step_seconds += seconds
        for phase in PHASES:
            self.phase_seconds[phase] += float(record.get(f"time/{phase}", 0.0))
        for key in BUSY_KEYS:
            if key in record:
                self.busy_key = key
                self.busy_weighted += float(record[key]) * seconds
                self.busy_seconds += seconds

    @property
    def busy_fraction(self) -> float | None:
        return self.busy_weighted / self.busy_seconds if self.busy_seconds > 0 else None

    def rows(self) -> list[tuple[str, float, float]]:
        """(phase, seconds, share of the steps' wall time) for each phase that took any time, then `other`."""
        total = max(self.step_seconds, 1e-9)
        rows = [(p, s, s / total) for p, s in self.phase_seconds.items() if s > 0]
        other = self.step_seconds - sum(self.phase_seconds.values())
        rows.append(("other", max(other, 0.0), max(other, 0.0) / total))
        return rows

    def render(self) -> str:
        if self.steps == 0:
            return "no steps ran"
        lines = [
            f"time per phase over {self.steps} step(s), {self.step_seconds:.1f} s in steps "
            f"({self.step_seconds / self.steps:.3f} s a step):",
            f"  {'phase':<12}{'seconds':>10}{'share':>8}{'per step':>10}",
        ]
        for phase, seconds, share in self.rows():
            lines.append(f"  {phase:<12}{seconds:>10.2f}{share:>8.1%}{seconds / self.steps:>10.3f}")
        overlap = sum(self.phase_seconds.values()) - self.step_seconds
        if overlap > 0.01 * self.step_seconds:
            lines.append(f"  (phases overlapped by {overlap:.2f} s: the next rollout ran during the update)")
        if (busy := self.busy_fraction) is not None:
            lines.append(f"  {self.busy_key} {busy:.2f} (time-weighted mean over the steps)")
        return "\n".join(lines)
