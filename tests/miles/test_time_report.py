"""The end-of-run report of where the steps' time went."""

import pytest

from miles.rl.time_report import TimeReport


def test_phases_are_summed_and_the_rest_is_other() -> None:
    report = TimeReport()
    report.add({"time/step": 2.0, "time/rollout": 1.0, "time/reward": 0.25, "time/train": 0.5, "x": 9.0})
    report.add({"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.25, "time/sync": 0.05})
    rows = {phase: (seconds, share) for phase, seconds, share in report.rows()}
    assert rows["rollout"] == (1.5, 0.5)
    assert rows["train"] == (0.75, 0.25)
    assert rows["other"][0] == pytest.approx(3.0 - 1.5 - 0.25 - 0.75 - 0.05)
    assert "eval" not in rows  # a phase that never ran is not listed
    text = report.render()
    assert "over 2 step(s)" in text and "overlapped" not in text


def test_busy_fraction_is_weighted_by_step_time_and_overlap_is_shown() -> None:
    report = TimeReport()
    report.add({"time/step": 3.0, "time/rollout": 2.0, "time/train": 2.0, "util/gpu_busy_frac": 0.9})
    report.add({"time/step": 1.0, "time/rollout": 0.5, "util/gpu_busy_frac": 0.1})
    assert report.busy_fraction == pytest.approx((0.9 * 3 + 0.1 * 1) / 4)
    assert dict((p, s) for p, s, _ in report.rows())["other"] == 0.0
    text = report.render()
    assert "util/gpu_busy_frac 0.70" in text and "overlapped by 0.50 s" in text


def test_no_steps() -> None:
    assert TimeReport().render() == "no steps ran"
