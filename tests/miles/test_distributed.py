"""Data parallelism (miles/distributed/): ranks' metrics combined, a data-parallel trainer step equal to
one process's on the whole batch, and `placement.num_processes=2` runs of the RL loop on CPU (gloo)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from miles.distributed import SINGLE, DataParallel, combine_metrics, launch
from tests.support.dp import make_trainer, scored_samples, tiny_moe, train_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_combine_metrics_adds_counts_takes_maxima_and_weights_means() -> None:
    a = {"reward/mean": 1.0, "reward/std": 0.0, "reward/errors": 2.0, "time/rollout": 3.0, "x/max": 4.0}
    b = {"reward/mean": 0.0, "reward/std": 0.0, "reward/errors": 1.0, "time/rollout": 5.0, "x/max": 1.0}
    b["rollout/tokens_per_s"] = 10.0
    out = combine_metrics([a, b], [3.0, 1.0])
    assert out["reward/mean"] == pytest.approx(0.75)
    # pooled: three samples at 1 and one at 0 -> population std sqrt(0.75 * 0.25)
    assert out["reward/std"] == pytest.approx(math.sqrt(0.75 * 0.25))
    assert out["reward/errors"] == 3.0 and out["time/rollout"] == 5.0 and out["x/max"] == 4.0
    assert out["rollout/tokens_per_s"] == 10.0  # only one rank reported it
    # a mean with its own count is weighted by the count, not by the ranks' samples
    c = combine_metrics(
        [{"r/f/mean": 1.0, "r/f/count": 1.0}, {"r/f/mean": 0.0, "r/f/count": 3.0}], [5.0, 5.0]
    )
    assert c["r/f/mean"] == pytest.approx(0.25) and c["r/f/count"] == 4.0


def test_combine_metrics_with_nan_ranks_without_samples_and_per_sample_eval_means() -> None:
    nan = math.nan
    # A NaN maximum or duration on any rank shows, whatever the ranks' order (Python's max kept or dropped it
    # by position); sums and means carry it as before.
    for pair in ([{"x/max": 1.0, "time/step": nan}, {"x/max": nan, "time/step": 2.0}],):
        for ranks in (pair, pair[::-1]):
            out = combine_metrics(ranks, [1.0, 1.0])
            assert math.isnan(out["x/max"]) and math.isnan(out["time/step"])
    assert math.isnan(combine_metrics([{"r/min": nan}, {"r/min": 0.0}], [1.0, 1.0])["r/min"])
    # A rank without samples (weight 0) does not count in a mean, even when what it reports is NaN.
    out = combine_metrics(
        [{"reward/mean": nan, "reward/std": nan}, {"reward/mean": 0.5, "reward/std": 0.5}], [0.0, 4.0]
    )
    assert out == {"reward/mean": 0.5, "reward/std": 0.5}
    # Counts the engine reports add up over the ranks' engines.
    out = combine_metrics(
        [{"rollout/spec_chained_drafts": 10.0}, {"rollout/spec_chained_drafts": 6.0}], [4, 4]
    )
    assert out["rollout/spec_chained_drafts"] == 16.0
    # eval/reward_mean and eval/response_length are means over samples (a generate plugin may give a prompt
    # several); eval/accuracy is over prompts.
    ranks = [
        {"eval/accuracy": 1.0, "eval/reward_mean": 1.0, "eval/response_length": 3.0, "eval/count": 1.0},
        {"eval/accuracy": 0.0, "eval/reward_mean": 0.0, "eval/response_length": 9.0, "eval/count": 1.0},
    ]
    ranks[0]["eval/num_samples"], ranks[1]["eval/num_samples"] = 3.0, 1.0
    out = combine_metrics(ranks, [3.0, 1.0])
    assert out["eval/accuracy"] == 0.5
    assert out["eval/reward_mean"] == pytest.approx(0.75)
    assert out["eval/response_length"] == pytest.approx((3 * 3 + 9) / 4)


def test_shard_keeps_whole_items_in_order() -> None:
    items = list(range(7))
    shards = [DataParallel(rank=r, world_size=3).shard(items) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert SINGLE.shard(items) == items


CASES = {
    "token_mean": {"num_samples": 10, "global_batch_size": 10, "loss_agg": "token_mean"},
    "seq_mean_two_optimizer_steps_tis": {
        "num_samples": 11,
        "global_batch_size": 6,
        "loss_agg": "seq_mean_token_mean",
        "tis": True,
    },
    "token_sum_two_epochs": {
        "num_samples": 8,
        "global_batch_size": 8,
        "loss_agg": "seq_mean_token_sum",
        "epochs": 2,
    },
    "bf16_master_weights": {  # float32 master gradients summed across ranks
        "num_samples": 8,
        "global_batch_size": 8,
        "loss_agg": "token_mean",
        "dtype": "bfloat16",
    },
    "one_rank_without_samples": {
        "num_samples": 5,
        "global_batch_size": 5,
        "loss_agg": "token_mean",
        "shards": [[0, 1, 2, 3, 4], []],
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_data_parallel_step_equals_one_process_on_the_whole_batch(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    world = 2
    mp.start_processes(
        train_worker, args=(world, free_port(), case, str(tmp_path)), nprocs=world, start_method="spawn"
    )
    dtype = getattr(torch, case.get("dtype", "float32"))
    model = tiny_moe().to(dtype)
    trainer = make_trainer(model, case, SINGLE)
    samples = scored_samples(case["num_samples"])
    expected = [trainer.train_step(samples) for _ in range(case.get("steps", 1))]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(world)]
    for name_, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name_]), f"the replicas differ in {name_}"  # bit for bit
    moved = 0.0
    initial = tiny_moe().to(dtype).float().state_dict()
    weights, rel = model.state_dict(), 1e-5
    if trainer.masters is not None:
        # bf16 weights round the float32 masters: compare those (a last-bit difference may flip a rounding).
        # A bf16 forward rounds differently in other micro-batches, which flips the sign of a few ~0
        # gradients (one process with other micro-batches flips as many): Adam then moves those weights by
        # -lr instead of +lr. All others must agree as in float32.
        weights, rel = dict(trainer.masters.named_masters()), 2e-2
        ranks[0] = {k.removeprefix("master."): v for k, v in ranks[0].items() if k.startswith("master.")}
        assert ranks[0].keys() == weights.keys()
    lr = case.get("lr", 1e-2)
    for name_, value in weights.items():
        # Adam's first steps move each weight by about lr * sign(grad), so a gradient that is ~0 up to the
        # order of float additions can move a weight by a little more or less: 1 % of lr. Scale errors do
        # not show here (Adam divides them out); train/grad_norm below compares them.
        if trainer.masters is None:
            torch.testing.assert_close(ranks[0][name_], value, rtol=0, atol=1e-4)
        else:
            diff = (ranks[0][name_] - value).abs()
            assert diff.max() <= 2.05 * lr and (diff > 1e-4).float().mean() < 0.02, name_
        moved = max(moved, (value - initial[name_]).abs().max().item())
    assert moved > 1e-3  # the step changed the weights, so equal weights mean equal updates
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert json.loads((tmp_path / "rank1.json").read_text()) == got  # every rank reports the batch's metrics
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/tokens"):
        assert got[-1][key] == pytest.approx(expected[-1][key], rel=rel, abs=1e-7), key
    assert got[-1]["train/optimizer_steps"] == expected[-1]["train/optimizer_steps"]
    if "mismatch/logprob_abs_diff_mean" in expected[-1]:
        for key in ("mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl"):
            assert got[-1][key] == pytest.approx(expected[-1][key], rel=1e-5), key


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume(tmp_path: Path) -> None:
    """`placement.num_processes=2` on CPU: each rank generates half of the groups, and the first step's
    samples, rewards and update are one process's (deterministic mode: a request draws the same whatever
    else is in the batch); the replicas stay identical; rank 0 writes the run folder; a run resumed from
    the step-1 checkpoint repeats step 2 bit for bit."""
    from tests.support.cli import run_miles

    common = [
        "recipe=grpo_math",
        "trainer.max_steps=2",
        "trainer.save_every=1",
        "trainer.eval_every=2",
        "data.test_size=8",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=8",  # two optimizer steps a rollout: their samples must be one process's
        "rollout.deterministic=true",
        "data.train_size=64",  # not the recipe's 20000 to tokenise
    ]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    out = run_miles(tmp_path, *common, run_dir=one)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *common, "placement.num_processes=2", run_dir=two)
    assert out.returncode == 0, out.stderr[-3000:]
    single, double = _records(one), _records(two)
    assert [r["step"] for r in double] == [0, 1, 2]
    assert double[0]["eval/accuracy"] == single[0]["eval/accuracy"]
    assert double[0]["eval/num_samples"] == single[0]["eval/num_samples"] == 8
    first, expected = double[1], single[1]
    for key in (
        "reward/mean",
        "reward/std",
        "response_length/mean",
        "rollout/output_tokens",
        "adv/num_groups",
    ):
        assert first[key] == pytest.approx(expected[key], rel=1e-9), key
    for key in ("train/loss", "train/grad_norm", "train/entropy", "mismatch/logprob_abs_diff_mean"):
        assert first[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    assert all(r["sync/replicas_equal"] == 1.0 and r["sync/checksum_ok"] == 1.0 for r in double[1:])
    rows = [json.loads(line) for line in (two / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {1, 2}  # one writer: rank 0
    state = json.loads((two / "checkpoints" / "step_000001" / "resume" / "run_state.json").read_text())
    assert len(state["engine"]["ranks"]) == 2

    out = run_miles(
        tmp_path,
        *common,
        "placement.num_processes=2",
        f"trainer.resume_from={two / 'checkpoints' / 'step_000001'}",
        run_dir=resumed,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    again = _records(resumed)[-1]
    for key in ("reward/mean", "train/loss", "train/grad_norm", "response_length/mean", "eval/accuracy"):
        assert again[key] == double[-1][key], key


def test_a_failing_rank_fails_the_run_with_its_error(tmp_path: Path) -> None:
    from tests.support.cli import run_miles

    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=1",
        "placement.num_processes=2",
        "model.path=/nonexistent/model",
        run_dir=tmp_path / "bad",
    )
    assert out.returncode == 2
    assert "/nonexistent/model" in out.stderr and "a process of the run exited with code" in out.stderr


_RANK_PROGRAM = """
import os, sys, time
folder, world = sys.argv[1], int(os.environ["WORLD_SIZE"])
open(os.path.join(folder, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
if os.environ["RANK"] == sys.argv[2]:
    while not all(os.path.exists(os.path.join(folder, "pid%d" % r)) for r in range(world)):
        time.sleep(0.01)  # fail once every rank runs
    sys.exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split()[2] == "Z")


@pytest.mark.parametrize("failing_rank", ["0", "2"])
def test_the_launcher_stops_every_rank_when_any_fails(tmp_path: Path, failing_rank: str) -> None:
    start = time.monotonic()
    program = [sys.executable, "-c", _RANK_PROGRAM, str(tmp_path), failing_rank]
    assert launch(tmp_path, 3, poll_s=0.05, command=program) == 3
    assert time.monotonic() - start < 60  # not the survivors' 120 s
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert not any(_alive(pid) for pid in pids)


def test_launched_ranks_meet_in_a_fresh_file_store_that_is_removed_after(tmp_path: Path) -> None:
    # no TCP port is probed and handed over (another program could take it before rank 0 binds it)
    program = (
        "import os, sys, torch.distributed as dist; from pathlib import Path; "
        "from miles.distributed import init_data_parallel, shutdown; "
        "store = os.environ['MILES_STORE_FILE']; Path(sys.argv[1], 'store').write_text(store); "
        "dp = init_data_parallel(2, 'cpu', timeout_s=60); "
        "assert dist.get_world_size() == 2 and 'MASTER_PORT' not in os.environ; "
        "assert dp.all_reduce_floats([float(dp.rank + 1)]) == [3.0]; shutdown(dp)"
    )
    env_port = os.environ.pop("MASTER_PORT", None)
    try:
        assert launch(tmp_path, 2, poll_s=0.05, command=[sys.executable, "-c", program, str(tmp_path)]) == 0
    finally:
        if env_port is not None:
            os.environ["MASTER_PORT"] = env_port
    store = Path((tmp_path / "store").read_text())
    assert not store.parent.exists()


def test_a_store_folder_a_killed_launcher_left_is_removed_by_the_next(tmp_path: Path) -> None:
    from miles.distributed.launcher import remove_stale_stores

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"miles-launch-{dead.pid}-abc"
    live = tmp_path / f"miles-launch-{os.getpid()}-def"  # a launcher still running: kept
    other = tmp_path / "miles-launch-notapid"
    for folder in (stale, live, other):
        (folder / "store").parent.mkdir()
        (folder / "store").write_text("")
    remove_stale_stores(tmp_path)
    assert not stale.exists() and live.exists() and other.exists()


def test_a_terminated_launcher_stops_its_ranks(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from miles.distributed import launch; "
        f"sys.exit(launch(Path({str(tmp_path)!r}), 2, command=[sys.executable, '-c', {_RANK_PROGRAM!r}, "
        f"{str(tmp_path)!r}, '-1']))"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").is_file() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    assert not any(_alive(pid) for pid in pids)


def test_sft_on_two_processes_takes_one_process_steps(tmp_path: Path) -> None:
    from tests.support.cli import run_miles

    common = [
        "recipe=sft_math",
        "trainer.max_steps=2",
        "trainer.save_every=1",
        "trainer.eval_every=2",
        "data.train_size=32",
        "data.test_size=4",
        "trainer.sft_batch_size=16",
    ]
    out = run_miles(tmp_path, *common, run_dir=tmp_path / "one")
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *common, "placement.num_processes=2", run_dir=tmp_path / "two")
    assert out.returncode == 0, out.stderr[-3000:]
    single, double = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in double] == [r["step"] for r in single] == [0, 1, 2]  # eval at the start too
    for mine, theirs in zip(double[1:], single[1:], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert double[0]["eval/num_samples"] == double[-1]["eval/num_samples"] == 4
    assert double[0]["eval/accuracy"] == pytest.approx(single[0]["eval/accuracy"])
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]


def test_launched_ranks_run_the_config_handed_to_them_privately(tmp_path: Path) -> None:
    """The run folder's config.yaml may have its secrets masked: the ranks read the unredacted config from a
    copy only this user can read, in the launch's store folder, removed after."""
    (tmp_path / "config.yaml").write_text("reward:\n  kwargs:\n    api_key: '***'\n")
    program = (
        "import os, sys, stat; from pathlib import Path; "
        "path = Path(os.environ['MILES_CONFIG_FILE']); "
        "assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode); "
        "Path(sys.argv[1], 'seen' + os.environ['RANK']).write_text(path.read_text() + '|' + str(path))"
    )
    command = [sys.executable, "-c", program, str(tmp_path)]
    secret = "reward:\n  kwargs:\n    api_key: sk-live-1\n"
    assert launch(tmp_path, 2, poll_s=0.05, command=command, config_text=secret) == 0
    for rank in range(2):
        text, path = (tmp_path / f"seen{rank}").read_text().split("|")
        assert text == secret and not Path(path).exists()
    # without config_text: the run folder's config.yaml, as before
    assert launch(tmp_path, 2, poll_s=0.05, command=command) == 0
    assert (tmp_path / "seen0").read_text().split("|")[0] == (tmp_path / "config.yaml").read_text()
