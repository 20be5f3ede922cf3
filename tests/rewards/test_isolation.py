"""User reward code (a file or module) runs out of the trainer's process by default, whatever
reward.num_workers says (the recipes' math config sets 0): whatever it does costs its samples, never the run, and
leaves no process behind. In-process stays an explicit choice (reward.in_process=true)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles.config import RewardConfig
from miles.rewards import RewardRunner
from miles.sample import Sample

HOSTILE = str(Path(__file__).parent / "data" / "hostile_rewards.py")
ACTIONS = ["ok", "exit", "sigkill", "segfault", "allocate", "fork", "daemon", "fork_returns", "hang", "ok"]


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead: it holds no memory and runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_hostile_user_rewards_cost_their_samples_never_the_trainer(tmp_path: Path) -> None:
    """As a training run with the recipes' reward config (num_workers: 0) and reward.fn=my_file.py:f: the
    "trainer" (a child process here, so that a reward that kills it cannot take pytest along) survives every
    reward, scores what it can, and is left with no process a reward started, during the run and after."""
    script = textwrap.dedent(
        f"""
        import json, os, time
        from pathlib import Path
        from miles.config import RewardConfig
        from miles.rewards import RewardRunner
        from miles.sample import Sample

        def alive(pid):
            try:
                state = Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, IndexError):
                return False
            return state != "Z"

        if __name__ == "__main__":
            cfg = RewardConfig(fn={HOSTILE + ":hostile"!r}, num_workers=0, timeout_s=3.0, worker_memory_mb=512)
            batch = [Sample(response_text=a, label={str(tmp_path)!r}) for a in {ACTIONS!r}]
            with RewardRunner(cfg) as runner:
                runner.score(batch)
                time.sleep(0.3)
                pids = [int(p) for p in Path({str(tmp_path / "pids")!r}).read_text().split()]
                during = [p for p in pids if alive(p)]
            print(json.dumps({{
                "kinds": [s.reward_info.get("error_kind") for s in batch],
                "rewards": [s.reward for s in batch],
                "scored_in": sorted({{s.reward_info.get("pid") for s in batch if "pid" in s.reward_info}}),
                "trainer": os.getpid(),
                "started": pids,
                "alive_during": during,
            }}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the trainer died with {out.returncode}: {out.stderr[-3000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kinds"] == [None, "crash", "crash", "crash", "memory", None, None, None, "timeout", None]
    assert result["rewards"] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert result["trainer"] not in result["scored_in"]  # user code ran in worker processes
    assert len(result["started"]) == 2 and result["alive_during"] == []  # killed after their call
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in result["started"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in result["started"] if _alive(p)]


def _in_process(cfg: RewardConfig) -> RewardConfig:
    cfg.in_process = True  # reward.in_process=true: the explicit choice to run user code in the trainer
    return cfg


def test_user_rewards_run_in_workers_unless_in_process_is_chosen() -> None:
    batch = [Sample(response_text="ok", label="x") for _ in range(3)]
    with RewardRunner(RewardConfig(fn=f"{HOSTILE}:hostile", num_workers=0)) as runner:
        runner.score(batch)
    assert {s.reward_info["pid"] for s in batch} - {os.getpid()} == {s.reward_info["pid"] for s in batch}
    with RewardRunner(_in_process(RewardConfig(fn=f"{HOSTILE}:hostile", num_workers=2))) as runner:
        runner.score(batch)
    assert {s.reward_info["pid"] for s in batch} == {os.getpid()}


def test_async_user_rewards_run_in_workers_concurrently() -> None:
    """An async user reward (I/O-bound) runs in a worker too, its chunk's samples concurrently there."""
    batch = [Sample(response_text="ok", label="x") for _ in range(16)]
    start = time.monotonic()
    with RewardRunner(RewardConfig(fn=f"{HOSTILE}:async_pid", num_workers=2, timeout_s=5)) as runner:
        runner.score(batch)
        runner.score(batch)
    assert [s.reward for s in batch] == [1.0] * 16
    assert os.getpid() not in {s.reward_info["pid"] for s in batch}
    assert time.monotonic() - start < 16 * 0.3  # not one after another


@pytest.mark.parametrize("spec", ["math", "exact_match"])
def test_built_ins_stay_in_process_with_num_workers_0(spec: str) -> None:
    with RewardRunner(RewardConfig(fn=spec, num_workers=0)) as runner:
        assert runner._pool is None  # no worker processes to start for the recipes' math config


def test_a_helper_the_constructor_started_lives_as_long_as_the_worker() -> None:
    """Only what a call leaves behind is killed after it: a class reward's own helper (started in its
    constructor) serves every call, and dies with the worker at close."""
    with RewardRunner(RewardConfig(fn=f"{HOSTILE}:KeepsAHelper", num_workers=1, timeout_s=5)) as runner:
        for _ in range(2):
            batch = [Sample(response_text="ok", label="x") for _ in range(3)]
            runner.score(batch)
            assert [s.reward for s in batch] == [1.0, 1.0, 1.0]
        helper = batch[0].reward_info["helper"]
        assert _alive(helper)
    deadline = time.monotonic() + 5
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper)


def test_an_async_batched_user_reward_gets_the_whole_list_in_a_worker() -> None:
    batch = [Sample(response_text="ok", label="x") for _ in range(4)]
    cfg = RewardConfig(fn=f"{HOSTILE}:async_batched", batched=True, num_workers=0)
    with RewardRunner(cfg) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [0.0, 1.0, 2.0, 3.0]
    assert os.getpid() not in {s.reward_info["pid"] for s in batch}


def test_with_num_workers_0_built_ins_stay_in_the_trainer_beside_user_code_in_workers() -> None:
    cfg = RewardConfig(weights={"exact_match": 1.0, f"{HOSTILE}:hostile": 1.0}, num_workers=0)
    with RewardRunner(cfg) as runner:
        placements = {fn.name: runner._placement(fn) for fn in runner.functions.values()}
        batch = [Sample(response_text="ok", label="ok")]
        runner.score(batch)
    assert placements == {"exact_match": "local", "hostile": "pool"}
    assert batch[0].reward == 2.0 and batch[0].reward_info["hostile/pid"] != os.getpid()
