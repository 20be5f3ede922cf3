"""The runner survives hostile rewards (hangs, exceptions, NaN, bad returns, crashes, memory blow-ups) with exact
counters, logs each failure kind once, recovers its workers, and cancels calls at shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

import miles.rewards.in_trainer as in_trainer
from miles.config import RewardConfig
from miles.rewards import RewardRunner
from miles.sample import Sample

USER = str(Path(__file__).parent / "data" / "user_rewards.py")


def batch_of(*responses: str) -> list[Sample]:
    return [Sample(response_text=r, label="1") for r in responses]


def kinds(batch: list[Sample]) -> list[str | None]:
    return [s.reward_info.get("error_kind") for s in batch]


def in_process(cfg: RewardConfig) -> RewardConfig:
    """reward.in_process=true: user code in the trainer's process (the in-process executor's tests); without
    it user code runs in workers whatever num_workers says."""
    cfg.in_process = True
    return cfg


def test_hostile_rewards_in_worker_processes(caplog: pytest.LogCaptureFixture) -> None:
    responses = [
        "ok",
        "raise",
        "nan",
        "sleep",
        "ok",
        "inf",
        "string",
        "nodict",
        "exit",
        "raise",
        "sleep",
        "ok",
    ]
    batch = batch_of(*responses)
    cfg = RewardConfig(fn=f"{USER}:selective", timeout_s=1.5, num_workers=2)
    with caplog.at_level(logging.WARNING, logger="miles.rewards"), RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
        assert kinds(batch) == [
            None,
            "exception",
            "nan",
            "timeout",
            None,
            "nan",
            "bad_return",
            "bad_return",
            "crash",
            "exception",
            "timeout",
            None,
        ]
        assert [s.reward for s in batch] == [1.0, 0, 0, 0, 1.0, 0, 0, 0, 0, 0, 0, 1.0]
        assert metrics["reward/errors"] == 9.0
        assert metrics["reward/timeouts"] == 2.0
        assert metrics["reward/mean"] == pytest.approx(3 / 12)
        assert metrics["reward/worker_restarts"] == 3.0  # two hung workers killed, one that exited
        assert "ValueError: this reward raised on purpose" in batch[1].reward_info["error"]
        assert "return a float or a dict" in batch[6].reward_info["error"]
        assert "'score'" in batch[7].reward_info["error"]

        again = batch_of(
            "ok", "ok", "raise", "ok"
        )  # the pool recovered; known failure kinds are not re-logged
        metrics = runner.score(again)
        assert [s.reward for s in again] == [1.0, 1.0, 0.0, 1.0]
        assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 0.0
    failure_logs = [r for r in caplog.records if r.name == "miles.rewards" and "failed (" in r.getMessage()]
    logged_kinds = sorted(r.getMessage().split("failed (")[1].split(")")[0] for r in failure_logs)
    assert logged_kinds == ["bad_return", "crash", "exception", "nan", "timeout"]
    assert "Traceback" in next(r.getMessage() for r in failure_logs if "failed (exception)" in r.getMessage())


def test_memory_leak_and_huge_allocation_are_contained() -> None:
    # One worker capped at 250 MB over its start-up size; each "leak" call keeps 100 MB: every third call in a
    # worker's life fails with a MemoryError, after which the worker is replaced with a fresh heap.
    cfg = RewardConfig(fn=f"{USER}:selective", num_workers=1, worker_memory_mb=250, timeout_s=20)
    batch = batch_of("leak", "leak", "leak", "leak", "leak", "leak", "huge", "ok")
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert kinds(batch) == [None, None, "memory", None, None, "memory", "memory", None]
    assert metrics["reward/errors"] == 3.0
    assert metrics["reward/worker_restarts"] == 3.0
    assert [s.reward for s in batch] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_hostile_rewards_in_process() -> None:
    batch = batch_of("ok", "raise", "nan", "sleep", "string", "ok")
    with RewardRunner(
        in_process(RewardConfig(fn=f"{USER}:selective", timeout_s=0.5, num_workers=0))
    ) as runner:
        metrics = runner.score(batch)
        assert kinds(batch) == [None, "exception", "nan", "timeout", "bad_return", None]
        assert metrics["reward/errors"] == 4.0 and metrics["reward/timeouts"] == 1.0
        again = batch_of("ok", "ok")  # a fresh helper thread took over from the abandoned one
        assert runner.score(again)["reward/mean"] == 1.0


def test_an_in_process_reward_stuck_on_every_sample_costs_three_timeouts_a_batch() -> None:
    """Calls in the trainer's process run one after another and cannot be killed: after three timeouts in a
    row the reward's other samples of the batch fail at once (counted as timeouts) rather than each waiting
    `timeout_s`; a call that returns resets the count, and the next batch tries again."""
    batch = batch_of("sleep", "sleep", "ok", "sleep", "sleep", "sleep", "sleep", "sleep", "ok")
    with RewardRunner(
        in_process(RewardConfig(fn=f"{USER}:selective", timeout_s=0.3, num_workers=0))
    ) as runner:
        metrics = runner.score(batch)
        assert kinds(batch) == ["timeout"] * 2 + [None] + ["timeout"] * 6
        assert metrics["reward/timeouts"] == 8.0
        assert runner._local.abandoned == 5  # 2 + 3 threads given up on, not 8
        assert all("not run" in s.reward_info["error"] for s in batch[6:])
        assert "took longer" in batch[5].reward_info["error"]
        assert runner.score(batch_of("ok"))["reward/mean"] == 1.0


def test_a_reward_that_drives_an_engine_is_waited_for_not_abandoned() -> None:
    """An engine is stepped by one thread at a time: a judge past reward.timeout_s is waited for (its
    generation ends by itself), so no abandoned thread goes on stepping the engine beside the next call."""
    cfg = in_process(
        RewardConfig(fn=f"{USER}:SlowJudge", kwargs={"seconds": 0.4}, timeout_s=0.1, num_workers=0)
    )
    with RewardRunner(cfg) as runner:
        batch = batch_of("a", "b", "c")
        metrics = runner.score(batch)
        assert kinds(batch) == [None, None, None] and metrics["reward/mean"] == 1.0
        assert runner._local.abandoned == 0
        assert not any(s.reward_info.get("overlapped") for s in batch)


@pytest.mark.parametrize("trainer", [False, True])
def test_async_rewards_time_out_and_a_blocked_loop_is_replaced(
    monkeypatch: pytest.MonkeyPatch, trainer: bool
) -> None:
    """In a worker (the default for user code) or in the trainer (reward.in_process=true) alike."""
    batch = batch_of("ok", "sleep", "raise", "ok")
    cfg = RewardConfig(fn=f"{USER}:async_selective", timeout_s=0.5)
    with RewardRunner(in_process(cfg) if trainer else cfg) as runner:
        metrics = runner.score(batch)
    assert kinds(batch) == [None, "timeout", "exception", None]
    assert metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 1.0
    if not trainer:
        return

    monkeypatch.setattr(in_trainer, "ASYNC_GRACE_S", 0.5)
    blocked = batch_of("a", "b")
    with RewardRunner(in_process(RewardConfig(fn=f"{USER}:blocks_the_loop", timeout_s=0.5))) as runner:
        metrics = runner.score(blocked)
        assert kinds(blocked) == ["timeout", "timeout"]
        assert "blocked the event loop" in blocked[0].reward_info["error"]
        assert runner._local.abandoned == 1


def test_close_cancels_calls_in_flight_and_stops_workers() -> None:
    runner = RewardRunner(RewardConfig(fn=f"{USER}:selective", timeout_s=60, num_workers=1))
    batch = batch_of("sleep", "ok")
    result: dict = {}
    scorer = threading.Thread(target=lambda: result.update(runner.score(batch)))
    scorer.start()
    deadline = time.monotonic() + 30
    while runner._pool._slots[0].process is None and time.monotonic() < deadline:
        time.sleep(0.05)
    worker_pid = runner._pool._slots[0].process.pid
    time.sleep(0.5)  # the sleeping call is in flight
    runner.close()
    scorer.join(timeout=20)
    assert not scorer.is_alive()
    assert kinds(batch) == ["cancelled", "cancelled"]
    assert result["reward/errors"] == 2.0
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
    with pytest.raises(RuntimeError, match="after close"):
        runner.score(batch_of("ok"))
    runner.close()  # idempotent


def test_empty_batch() -> None:
    with RewardRunner(RewardConfig(fn="math", num_workers=0)) as runner:
        assert runner.score([]) == {
            "reward/mean": 0.0,
            "reward/std": 0.0,
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
        }


def test_score_early_starts_the_graders_before_score_and_gives_the_same_scores(tmp_path: Path) -> None:
    """`score_early` (the loop calls it as each group finishes generating) submits the pool's calls at once;
    `score` then waits for them instead of submitting again, with the scores and metrics a plain `score`
    gives; samples it was not given are scored as usual."""
    cfg = RewardConfig(fn=f"{USER}:logged_reward", kwargs={"log_dir": str(tmp_path)}, num_workers=2)
    with RewardRunner(cfg) as runner:
        batch = batch_of("aa", "bbb", "c", "dddd")
        runner.score_early(batch[:3])
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("scored-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.name for p in tmp_path.glob("scored-*")) == ["scored-aa", "scored-bbb", "scored-c"]
        metrics = runner.score(batch)
        assert (tmp_path / "scored-dddd").exists()
        assert [s.reward for s in batch] == [2.0, 3.0, 1.0, 4.0]
        assert metrics["reward/early/num_samples"] == 3 and metrics["reward/mean"] == 2.5
        again = batch_of("aa", "bbb", "c", "dddd")  # the early calls were used once: new objects, plain
        plain = runner.score(again)
        assert [s.reward for s in again] == [2.0, 3.0, 1.0, 4.0] and "reward/early/num_samples" not in plain
        assert {k: v for k, v in metrics.items() if k != "reward/early/num_samples"} == plain


def _reward_file(tmp_path: Path, source: str) -> str:
    path = tmp_path / "rewards_under_test.py"
    path.write_text(source)
    return str(path)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


def test_a_timed_out_reward_takes_the_processes_it_started_with_it(tmp_path: Path) -> None:
    marker = f"{time.time() % 1000:.6f}"  # an argument no other process has: `sleep 47.<marker>`
    source = f"import subprocess\ndef spawns(sample):\n    subprocess.run(['sleep', '47{marker}'])\n    return 1.0\n"
    cfg = RewardConfig(fn=f"{_reward_file(tmp_path, source)}:spawns", num_workers=1, timeout_s=1.0)
    try:
        with RewardRunner(cfg) as runner:
            batch = batch_of("x")
            runner.score(batch)
            assert kinds(batch) == ["timeout"]
            deadline = time.monotonic() + 5
            while _processes_with(f"47{marker}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _processes_with(f"47{marker}") == []  # killed with its worker's process group
    finally:
        for pid in _processes_with(f"47{marker}"):  # only what this test started, should it have survived
            os.kill(pid, 9)


def test_a_slow_class_constructor_does_not_count_against_the_sample_timeout(tmp_path: Path) -> None:
    source = (
        "import time\nclass SlowInit:\n    def __init__(self):\n        time.sleep(1.5)  # loads a model\n"
        "    def __call__(self, sample):\n        return 1.0\n"
    )
    cfg = RewardConfig(fn=f"{_reward_file(tmp_path, source)}:SlowInit", num_workers=1, timeout_s=0.5)
    with RewardRunner(cfg) as runner:
        batch = batch_of("a", "b", "c")
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [1.0, 1.0, 1.0]
    assert metrics["reward/errors"] == 0.0 and metrics["reward/worker_restarts"] == 0.0


def test_a_constructor_past_the_bind_timeout_fails_its_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import miles.rewards.pool as pool

    monkeypatch.setattr(pool, "BIND_TIMEOUT_S", 1.0)
    source = (
        "import time\nclass Hangs:\n    def __init__(self):\n        time.sleep(60)\n"
        "    def __call__(self, sample):\n        return 1.0\n"
    )
    cfg = RewardConfig(fn=f"{_reward_file(tmp_path, source)}:Hangs", num_workers=1, timeout_s=0.5)
    start = time.monotonic()
    with RewardRunner(cfg) as runner:
        batch = batch_of("a", "b")
        runner.score(batch)
    assert kinds(batch) == ["timeout", "timeout"]
    assert "building reward" in batch[0].reward_info["error"]
    assert time.monotonic() - start < 8


@pytest.mark.parametrize("num_workers", [0, 1])
def test_huge_scores_cost_their_sample_and_never_break_the_metrics(tmp_path: Path, num_workers: int) -> None:
    source = "def huge(sample):\n    return float(sample.response_text)\n"
    cfg = RewardConfig(fn=f"{_reward_file(tmp_path, source)}:huge", num_workers=num_workers)
    with RewardRunner(cfg) as runner:
        batch = batch_of("1e308", "1e308", "-1e31", "2.0")
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [0.0, 0.0, 0.0, 2.0]
    assert kinds(batch) == ["bad_return", "bad_return", "bad_return", None]
    assert metrics["reward/mean"] == 0.5 and metrics["reward/errors"] == 3.0


def test_weighted_totals_that_overflow_cost_their_sample(tmp_path: Path) -> None:
    source = "def big(sample):\n    return 1e29\n"
    cfg = RewardConfig(
        weights={f"{_reward_file(tmp_path, source)}:big": 1e300, "exact_match": 1.0}, num_workers=0
    )
    with RewardRunner(cfg) as runner:
        batch = batch_of("1", "1")
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [0.0, 0.0]
    assert "not finite" in batch[0].reward_info["error"]
    assert metrics["reward/mean"] == 0.0 and metrics["reward/big/mean"] == 1e29
