"""Tracker: a resumed run goes on logging to the interrupted run's W&B run (offline here, no key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import LoggingConfig
from miles.resume import read_run_state, write_run_state
from miles.tracking import Tracker


def test_a_resumed_tracker_logs_to_the_same_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggingConfig(wandb=True, wandb_mode="offline", progress=False, plot_every=0)
    first = Tracker(tmp_path / "first", cfg, {"a": 1}, "recipe", 4)
    first.log_step(1, {"reward/mean": 0.5})
    run_id = first.wandb_run_id
    first.close()
    assert run_id

    folder = tmp_path / "ckpt"
    folder.mkdir()
    trainer_state = {"tensors": {}, "meta": {}}
    config = {"trainer": {"max_steps": 4}, "recipe": "recipe"}
    write_run_state(folder, 1, config, trainer_state, {}, {}, wandb_run_id=run_id)
    assert json.loads((folder / "resume" / "run_state.json").read_text())["wandb_run_id"] == run_id
    state = read_run_state(folder)
    assert state.wandb_run_id == run_id

    second = Tracker(tmp_path / "second", cfg, {"a": 1}, "recipe", 4, wandb_run_id=state.wandb_run_id)
    second.log_step(2, {"reward/mean": 0.6})
    assert second.wandb_run_id == run_id
    second.close()
    assert list((tmp_path / "second" / "wandb").glob(f"offline-run-*-{run_id}"))


def test_the_wandb_run_goes_on_only_if_nothing_was_logged_past_the_checkpoint(tmp_path: Path) -> None:
    from miles.loop import _continued_wandb_run

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    write_run_state(checkpoint, 2, {"trainer": {"max_steps": 4}}, {"tensors": {}, "meta": {}}, {}, {}, "abc")
    state = read_run_state(checkpoint)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    assert _continued_wandb_run(checkpoint, state) == "abc"  # crashed during step 3
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    assert _continued_wandb_run(checkpoint, state) is None  # W&B would drop the new step 3


def test_a_metrics_line_cut_short_by_a_crash_does_not_stop_the_resume(tmp_path: Path) -> None:
    """A crash mid-write leaves half a record at the end of metrics.jsonl: the resume reads the whole ones
    (as samples.jsonl's cut lines are dropped) and the rewritten file holds only whole records."""
    from miles.tracking import read_records

    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2))
    (run / "metrics.jsonl").write_text(whole + '{"step": 3, "reward/me')
    (run / "samples.jsonl").write_text(json.dumps({"step": 1}) + "\n" + '{"step": 3, "resp')
    assert [r["step"] for r in read_records(run)] == [1, 2]
    cfg = LoggingConfig(wandb=False, progress=False, plot_every=0)
    tracker = Tracker(run, cfg, {}, "recipe", 4)
    tracker.carry_over(run, 2)
    tracker.log_step(3, {"reward/mean": 0.7})
    tracker.close()
    assert [r["step"] for r in read_records(run)] == [1, 2, 3]
    assert all(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())


def test_a_new_run_never_mixes_its_records_into_another_runs(tmp_path: Path) -> None:
    from miles.errors import MilesUserError
    from miles.tracking import check_new_run_dir

    run = tmp_path / "run"
    check_new_run_dir(run)  # no folder yet
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    check_new_run_dir(run)  # a run that failed before its first record
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(MilesUserError, match="trainer.resume_from="):
        check_new_run_dir(run)
    with pytest.raises(MilesUserError, match="already holds"):
        check_new_run_dir(run, tmp_path / "other")  # resuming another run into this one's folder
    check_new_run_dir(run, run)  # resuming this run into its own folder: its records are cut back
