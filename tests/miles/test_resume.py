"""Resuming (miles/resume.py): which checkpoint a run folder names."""

from __future__ import annotations

from pathlib import Path

from miles.resume import find_checkpoint, write_run_state


def _checkpoint(run: Path, step: int) -> Path:
    folder = run / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    write_run_state(folder, step, {"trainer": {"max_steps": 9}}, {"tensors": {}, "meta": {}}, {}, {})
    return folder


def test_a_run_folder_names_its_last_saved_checkpoint_not_a_stale_later_step(tmp_path: Path) -> None:
    """A run saved steps 1-3; resumed into its own folder from step 1 it saved a new step 2 and stopped
    (crashed, or a smaller trainer.max_steps). Its folder still holds the first course's step 3, whose
    record metrics.jsonl no longer has (cut back to step 1 at the resume). `trainer.resume_from=<run>` must
    go on from the new step 2, not from the abandoned step 3."""
    run = tmp_path / "run"
    for step in (1, 2, 3):
        _checkpoint(run, step)
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000002")
    new_step2 = _checkpoint(run, 2)  # the resumed course's, saved after the first course's step 3
    assert find_checkpoint(str(run), tmp_path / "next") == new_step2
    # an uninterrupted run: its last saved is its highest step
    other = tmp_path / "other"
    last = [_checkpoint(other, step) for step in (2, 4, 6)][-1]
    assert find_checkpoint(str(other), tmp_path / "next") == last
