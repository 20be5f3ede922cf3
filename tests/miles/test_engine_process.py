"""`placement.engine_process=true`: the RL loop with its engine in a process of its own, its weights pushed
over shared memory after every update, learns as the embedded run does."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import MilesConfig
from miles.config.validate import validate
from miles.errors import MilesUserError
from tests.support.cli import run_miles
from tests.support.placements import SAME_ON_EVERY_PLACEMENT, SHORT_GRPO
from tests.support.placements import records as _records

COMMON, SAME = SHORT_GRPO, SAME_ON_EVERY_PLACEMENT


def test_an_engine_process_run_equals_the_embedded_run(tmp_path: Path) -> None:
    embedded, separate = tmp_path / "embedded", tmp_path / "separate"
    out = run_miles(tmp_path, *COMMON, run_dir=embedded)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *COMMON, "placement.engine_process=true", run_dir=separate)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = _records(embedded), _records(separate)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert set(SAME) <= set(one[step])
        for key in SAME:
            assert math.isclose(two[step][key], one[step][key], rel_tol=1e-6, abs_tol=1e-6), (step, key)
    assert [r["eval/accuracy"] for r in (two[0], two[3])] == [r["eval/accuracy"] for r in (one[0], one[3])]
    steps = two[1:]
    assert all(r["sync/checksum_ok"] == 1.0 for r in steps)
    assert all(r["sync/transport"] == 2.0 for r in steps)  # shm on CPU
    assert all(r["sync/bytes"] > 0 for r in steps)  # weights moved, not shared


def test_ctrl_c_to_the_process_group_stops_after_the_step_and_the_engine_process_with_it(
    tmp_path: Path,
) -> None:
    """A terminal's Ctrl-C (or `timeout -s INT`) reaches every process of the group: the engine process and
    the reward workers leave it to the trainer side, which ends its step, saves, and stops them."""
    run_dir = tmp_path / "run"
    args = [*COMMON, "trainer.max_steps=200", "trainer.eval_every=0", "placement.engine_process=true"]
    args += ["reward.num_workers=2", "logging.wandb=false", "logging.progress=false"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "disabled"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while (
        not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline
    ):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-2000:]
    assert "trainer.resume_from" in stderr and "ChannelClosed" not in stderr
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last:06d}"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"weight_sync": {"transport": "shm"}}, "set placement.engine_process=true"),
        ({"placement": {"engine_process": True}, "weight_sync": {"transport": "inprocess"}}, "cannot reach"),
        ({"weight_sync": {"transport": "nccl"}}, "use one of"),
        ({"placement": {"engine_process": True, "num_processes": 2}}, "num_processes > 1"),
        ({"placement": {"engine_process": True}, "rollout": {"generate_fn": "x:y"}}, "generate_fn"),
    ],
)
def test_engine_process_settings_are_checked_at_start(overrides: dict, message: str) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        OmegaConf.structured(MilesConfig), {"model": {"path": "builtin:tiny_moe_math"}}, overrides
    )
    with pytest.raises(MilesUserError, match=message):
        validate(OmegaConf.to_object(cfg))
