"""How a run fails: refused at start with no run folder left, never sharing a folder with another run, its
records written before its checkpoint, a stop after steps that cannot learn, Ctrl-C kept resumable, and the
reason in run.log."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config import MilesConfig
from miles.config.validate import validate
from miles.errors import MilesUserError
from miles.rl.guards import FailedStepGuard, failed_step_reason
from miles.run_dir import LOCK, claim_default, lock, unlock
from tests.support.cli import run_miles

SHORT = [
    "recipe=grpo_math",
    "data.train_size=64",  # not the recipe's 20000 to tokenise
    "trainer.eval_every=0",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=4",
]


def _config(overrides: dict) -> MilesConfig:
    merged = OmegaConf.merge(
        OmegaConf.structured(MilesConfig), {"model": {"path": "builtin:tiny_moe_math"}}, overrides
    )
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens must be at least 1"),
        ({"trainer": {"lr": float("nan")}}, "trainer.lr must be a finite number"),
        ({"rollout": {"temperature": -1.0}}, "rollout.temperature must be >= 0"),
        ({"rollout": {"top_p": 0.0}}, "rollout.top_p must be in"),
        ({"rollout": {"kv_cache_bytes": 0}}, "rollout.kv_cache_bytes must be at least 1"),
        ({"rollout": {"speculative": "draft"}}, "needs a draft model"),
        ({"trainer": {"max_steps": -5}}, "trainer.max_steps must be at least 0"),
        ({"trainer": {"save_every": -1}}, "trainer.save_every must be at least 0"),
        ({"trainer": {"keep_last": -1}}, "trainer.keep_last must be at least 0"),
        ({"rollout": {"page_size": 0}}, "rollout.page_size must be >= 1"),  # the engine's own check, at start
    ],
)
def test_values_the_schema_cannot_bound_are_refused_at_start(overrides: dict, message: str) -> None:
    with pytest.raises(MilesUserError, match=message):
        validate(_config(overrides))


def test_model_dtype_auto_is_float32_on_cpu_and_left_alone_when_named() -> None:
    auto = _config({"model": {"dtype": "auto", "device": "cpu"}})
    validate(auto)
    assert auto.model.dtype == "float32"
    named = _config({"model": {"dtype": "bfloat16", "device": "cpu"}})
    validate(named)
    assert named.model.dtype == "bfloat16"


def test_a_refused_start_leaves_no_run_folder(tmp_path: Path) -> None:
    out = run_miles(tmp_path, "recipe=grpo_math", "trainer.max_steps=-5")
    assert out.returncode == 2
    assert "trainer.max_steps must be at least 0" in out.stderr
    assert not (tmp_path / "run").exists()


def test_default_run_folders_of_one_second_get_a_suffix(tmp_path: Path) -> None:
    now = datetime.datetime(2026, 12, 4, 20, 0, 0)
    first, second = claim_default(tmp_path, now), claim_default(tmp_path, now)
    assert first.name == "2026-12-04_20-00-00" and second.name == "2026-12-04_20-00-00_1"


def test_a_named_run_folder_held_by_a_live_run_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK).write_text(str(holder.pid))
        with pytest.raises(MilesUserError, match="still going"):
            lock(tmp_path)
        out = run_miles(tmp_path, *SHORT, "trainer.max_steps=1", run_dir=tmp_path)
        assert out.returncode == 2 and "still going" in out.stderr
    finally:
        holder.kill()
        holder.wait()
    held = lock(tmp_path)  # its holder is gone: taken over
    assert held.read_text() == str(os.getpid())
    unlock(held)
    assert not held.exists()


def test_a_steps_records_are_written_before_its_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A crash while saving step 1's checkpoint keeps step 1's records: a resume from the step before never
    skips one."""
    import miles.rl.parts as parts
    from miles.run import run

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(parts, "save_checkpoint", crash)
    cfg = _config(
        {
            "trainer": {"max_steps": 2, "save_every": 1, "eval_every": 0, "global_batch_size": 8},
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4},
            "logging": {"wandb": False, "progress": False},
            "data": {"test_size": 4},
        }
    )
    with pytest.raises(OSError, match="disk full"):
        run(cfg, tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


def test_the_failed_step_guard_names_the_cause_and_stops_at_its_limit() -> None:
    assert failed_step_reason({"reward/errors": 8.0, "train/optimizer_steps": 1.0}, 8).startswith(
        "every sample"
    )
    assert "no update" in failed_step_reason({"reward/errors": 0.0}, 8)
    assert "skipped" in failed_step_reason({"train/optimizer_steps": 2.0, "train/skipped_steps": 2.0}, 8)
    assert (
        failed_step_reason({"train/optimizer_steps": 2.0, "train/skipped_steps": 1.0, "train/loss": 0.1}, 8)
        is None
    )
    guard = FailedStepGuard(limit=2)
    guard.check(1, {"reward/errors": 8.0}, 8)
    guard.check(2, {"train/optimizer_steps": 1.0, "train/loss": 0.1}, 8)  # a good step resets the count
    guard.check(3, {"reward/errors": 8.0}, 8)
    with pytest.raises(MilesUserError, match="2 steps in a row could not learn"):
        guard.check(4, {"reward/errors": 8.0}, 8)


def test_a_run_whose_rewards_all_fail_stops_and_says_why_in_run_log(tmp_path: Path) -> None:
    plugin = tmp_path / "broken.py"
    plugin.write_text("def reward(sample):\n    raise RuntimeError('no grader here')\n")
    out = run_miles(
        tmp_path,
        *SHORT,
        "trainer.max_steps=10",
        "trainer.stop_after_failed_steps=2",
        "reward.num_workers=0",
        f"reward.fn={plugin}:reward",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "2 steps in a row could not learn" in out.stderr
    assert "run folder" in out.stdout and "step 1/10" in out.stdout + out.stderr
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2
    assert "could not learn" in (tmp_path / "run" / "run.log").read_text()


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_to_resume(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    run_dir = tmp_path / "run"
    args = [
        *SHORT,
        "trainer.max_steps=200",
        "trainer.save_every=0",
        "logging.wandb=false",
        "logging.progress=false",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-2000:]
    assert "trainer.resume_from" in stderr
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{last:06d}"]
    assert not (run_dir / LOCK).exists()


def test_a_failing_run_prints_no_secret_and_no_hydra_banner(tmp_path: Path) -> None:
    """An error that quotes an override (here a resume URL with credentials) is masked, and Hydra's failure
    banner, which lists every override verbatim, never prints."""
    secret = "hunter2-Zq8xV3mT9pLw"
    out = run_miles(
        tmp_path, *SHORT, "trainer.max_steps=1", f"trainer.resume_from=https://me:{secret}@example.org/x"
    )
    assert out.returncode == 2
    assert secret not in out.stdout + out.stderr
    assert (
        secret not in (tmp_path / "run" / "run.log").read_text()
        if (tmp_path / "run" / "run.log").exists()
        else True
    )
    assert "Error executing job" not in out.stdout + out.stderr


def test_a_save_removes_what_a_cut_short_save_left(tmp_path: Path) -> None:
    from miles.resume import save_checkpoint
    from tests.support.models import tiny_model

    partial = tmp_path / "checkpoints" / ".step_000001.tmp-abc123"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    save_checkpoint(tiny_model(), None, tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


def test_a_signal_repeated_at_once_is_one_stop_request_and_a_later_one_stops_now(monkeypatch) -> None:
    """`timeout -s INT` signals the run and then its process group: two deliveries of one request. Only a
    signal after the repeat window is the "again to stop now" one."""
    from miles.rl import guards

    clock = [100.0]
    monkeypatch.setattr(guards.time, "monotonic", lambda: clock[0])
    stop = guards.StopRequest()
    stop._ask(signal.SIGINT, None)
    clock[0] += 0.01
    stop._ask(signal.SIGINT, None)  # the group's copy: still a stop after the step
    assert stop.asked
    clock[0] += guards.REPEAT_WINDOW_S
    with pytest.raises(KeyboardInterrupt):
        stop._ask(signal.SIGINT, None)
