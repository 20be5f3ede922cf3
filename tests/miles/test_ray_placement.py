"""`placement.mode=ray` on a local CPU cluster: two trainer ranks and two engine actors, colocated (shm) and
disaggregated (gloo broadcast), repeat the embedded two-process run; an engine killed mid-rollout costs
neither the run nor a sample."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from miles.config import MilesConfig
from miles.config.validate import validate
from miles.errors import MilesUserError
from tests.support.cli import run_miles
from tests.support.placements import BATCH, SAME_ON_EVERY_PLACEMENT, SHORT_GRPO, N
from tests.support.placements import records as _records

ray = pytest.importorskip("ray")

COMMON = [*SHORT_GRPO, "placement.num_processes=2"]
RAY = ["placement=ray", "placement.num_processes=2", "placement.cpus_per_actor=0.5"]
SAME = (*SAME_ON_EVERY_PLACEMENT, "rollout/prefix_hit_rate")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The embedded placement's two-process run: each rank its engine and replica, every 2nd group."""
    tmp = tmp_path_factory.mktemp("embedded")
    out = run_miles(tmp, *COMMON, run_dir=tmp / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    return _records(tmp / "run")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, transport",
    [
        ([], 2.0),  # colocated: each rank syncs its own engine over shared memory
        (["placement.colocate=false", "placement.num_engines=2"], 3.0),  # rank 0 broadcasts (gloo)
    ],
    ids=["colocated", "disaggregated"],
)
def test_a_ray_run_repeats_the_embedded_two_process_run(
    tmp_path: Path, embedded: list[dict], layout: list[str], transport: float
) -> None:
    out = run_miles(tmp_path, *COMMON, *RAY, *layout, run_dir=tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [r["step"] for r in embedded] == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in SAME:
            assert math.isclose(records[step][key], embedded[step][key], rel_tol=1e-5, abs_tol=1e-5), (
                step,
                key,
            )
        assert records[step]["sync/checksum_ok"] == 1.0
        assert records[step]["sync/transport"] == transport
        assert records[step]["sync/replicas_equal"] == 1.0
        # Both engines served groups, and their metrics are logged apart too.
        assert records[step]["router/engine0_groups"] + records[step]["router/engine1_groups"] == BATCH
        assert "engine1/rollout/tokens_per_s" in records[step]
    assert records[3]["eval/accuracy"] == embedded[3]["eval/accuracy"]


IN_PROCESS = [
    "trainer.eval_every=0",
    "logging.samples_per_step=1000",
    "logging.wandb=false",
    "logging.progress=false",
]


@pytest.fixture(scope="module")
def cluster() -> object:
    """A local cluster in this process, for runs started here (their actors can be found and killed)."""
    ray.init(num_cpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()


TWO_TURNS = (
    "from miles.rollout.multiturn.rollout import Trajectory\n"
    "async def generate(client, sample, params):\n"
    "    traj = Trajectory(sample)\n"
    "    traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=16)))\n"
    "    traj.add_tokens(client.encode(' so'))\n"
    "    traj.add_turn(await client.generate(traj.ids, params))\n"
    "    return traj.to_sample(client.tokenizer)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [[], ["placement.colocate=false", "placement.num_engines=2"]],
    ids=["colocated", "disaggregated"],
)
def test_an_engine_killed_mid_rollout_is_restarted_and_no_sample_is_lost_or_repeated(
    tmp_path: Path, cluster: object, layout: list[str]
) -> None:
    """Multi-turn sessions run on the engine actors (a session stays on its engine); those of the killed
    engine are run again on its replacement. Disaggregated, rank 0 rebuilds its broadcast group with the
    replacement and the surviving engine."""
    from miles.run import run

    plugin = tmp_path / "two_turns.py"
    plugin.write_text(TWO_TURNS)
    generate_fn = f"rollout.generate_fn={plugin}:generate"
    cfg = _config(*COMMON, *RAY, *layout, *IN_PROCESS, "trainer.max_steps=4", generate_fn)
    killed: list[int] = []
    killer = threading.Thread(target=_kill_engine_mid_rollout, args=(tmp_path, killed), daemon=True)
    killer.start()
    run(cfg, tmp_path)
    killer.join(timeout=5)
    assert killed, "the engine was never seen busy after step 1"
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert sum(r["rollout/engine_restarts"] for r in records) == 1
    assert all(r["sync/checksum_ok"] == 1.0 for r in records)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    seen = Counter((r["step"], r["group_id"], r["index"]) for r in rows)
    expected = {(s, g, i) for s in range(1, 5) for g in range(BATCH) for i in range(N)}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert all(" so" in row["response"] for row in rows)  # the plugin's tool turn, on every sample
    assert all(r["rollout/generate_errors"] == 0.0 for r in records)
    assert max(r["mismatch/logprob_abs_diff_max"] for r in records) < 1e-3


HANGS_ONCE = (
    "import time\n"
    "from pathlib import Path\n"
    "from miles.rollout.multiturn.rollout import Trajectory\n"
    "MARK = Path(__file__).with_suffix('.hung')\n"
    "async def generate(client, sample, params):\n"
    "    traj = Trajectory(sample)\n"
    "    traj.add_turn(await client.generate(traj.ids, params))\n"
    "    if sample.index == 0 and not MARK.exists():  # blocks its engine's loop: a hung engine, once\n"
    "        MARK.write_text('hung')\n"
    "        time.sleep(600)\n"
    "    return traj.to_sample(client.tokenizer)\n"
)


def test_a_hung_engine_is_found_killed_and_its_prompts_run_again(tmp_path: Path, cluster: object) -> None:
    from miles.run import run

    plugin = tmp_path / "hangs_once.py"
    plugin.write_text(HANGS_ONCE)
    cfg = _config(
        *COMMON,
        *RAY,
        *IN_PROCESS,
        "trainer.max_steps=2",
        "placement.engine_hang_s=3",
        f"rollout.generate_fn={plugin}:generate",
    )
    run(cfg, tmp_path)
    assert (tmp_path / "hangs_once.hung").exists()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["rollout/engine_restarts"] == 1.0 and records[1]["rollout/engine_restarts"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert Counter((r["step"], r["group_id"], r["index"]) for r in rows) == Counter(
        {(s, g, i): 1 for s in (1, 2) for g in range(BATCH) for i in range(N)}
    )


def _kill_engine_mid_rollout(run_dir: Path, killed: list[int]) -> None:
    """SIGKILL engine-1's process once it is generating in step 2 or later."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not killed:
        metrics = run_dir / "metrics.jsonl"
        names = [n for n in ray.util.list_named_actors() if n.endswith("-engine-1.1")]
        if not names or not metrics.exists() or not metrics.read_text().strip():
            time.sleep(0.05)
            continue
        actor = ray.get_actor(names[0])
        try:
            health = ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayError:
            return
        if health["busy"]:
            os.kill(health["pid"], signal.SIGKILL)
            killed.append(health["pid"])
        time.sleep(0.005)


def test_a_trainer_rank_that_dies_stops_the_run_naming_it(tmp_path: Path, cluster: object) -> None:
    from miles.placement.ray.sides import TrainerRankFailed
    from miles.run import run

    cfg = _config(*COMMON, *RAY, *IN_PROCESS, "trainer.max_steps=20", "trainer.save_every=1")
    killer = threading.Thread(target=_kill_rank_after_step_1, args=(tmp_path,), daemon=True)
    killer.start()
    with pytest.raises(TrainerRankFailed, match=r"trainer rank 1 died while .*trainer.resume_from=auto"):
        run(cfg, tmp_path)
    assert list((tmp_path / "checkpoints").glob("step_*")), "no checkpoint to resume from"


def test_a_rank_that_died_is_named_over_a_rank_whose_collective_failed_with_it(
    cluster: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed rank's peers fail at once in their collective ("connection closed"), often before Ray
    reports the death: the error names the rank that died, the cause."""
    from miles.placement.ray import sides

    @ray.remote(num_cpus=0)
    class Rank:
        def ready(self) -> None:
            pass

        def fail_after(self, seconds: float) -> None:
            time.sleep(seconds)
            raise RuntimeError("[gloo] Connection closed by peer")

        def die_after(self, seconds: float) -> None:
            time.sleep(seconds)
            os._exit(1)

    ranks = [Rank.remote() for _ in range(3)]
    ray.get([rank.ready.remote() for rank in ranks])
    with pytest.raises(sides.TrainerRankFailed, match=r"trainer rank 1 died while training"):
        sides.gather_ranks([ranks[0].fail_after.remote(0.1), ranks[1].die_after.remote(1.0)], "training")
    monkeypatch.setattr(sides, "DEATH_GRACE_S", 1.0)
    began = time.monotonic()
    with pytest.raises(sides.TrainerRankFailed, match=r"trainer rank 0 failed while saving"):
        sides.gather_ranks([ranks[0].fail_after.remote(0.0), ranks[2].fail_after.remote(30)], "saving")
    assert time.monotonic() - began < 10  # no death came: the grace ends the wait, not the blocked rank
    for rank in ranks:
        ray.kill(rank)


def _kill_rank_after_step_1(run_dir: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        names = [n for n in ray.util.list_named_actors() if n.endswith("-rank-1")]
        if names and metrics.exists() and metrics.read_text().strip():
            os.kill(ray.get(ray.get_actor(names[0]).pid.remote()), signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_one_step_off_then_sigterm_saves_and_a_resume_finishes(tmp_path: Path, cluster: object) -> None:
    from miles.run import run

    common = [*COMMON, *RAY, *IN_PROCESS, "trainer.max_steps=5", "trainer.async_rollout=one_step"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    stopper = threading.Thread(target=_sigterm_after_step, args=(first, 2), daemon=True)
    stopper.start()
    with pytest.raises(KeyboardInterrupt, match="resume with trainer.resume_from"):
        run(_config(*common), first)
    saved = sorted((first / "checkpoints").glob("step_*"))
    assert saved and len(_records(first)) < 5
    run(_config(*common, f"trainer.resume_from={first}"), resumed)
    records = _records(resumed)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["sync/checksum_ok"] == 1.0 for r in records)
    assert records[0]["train/staleness_max"] == 0.0  # step 1 draws on the weights it trains
    assert records[1]["train/staleness_max"] == 1.0  # then one update behind
    resumed_at = int(saved[-1].name[5:]) + 1
    # The first step after the resume draws on the checkpoint's weights again, then the lag resumes.
    assert records[resumed_at - 1]["train/staleness_max"] == 0.0
    assert all(r["train/staleness_max"] == 1.0 for r in records[resumed_at:])


def _sigterm_after_step(run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.02)


def _config(*overrides: str) -> MilesConfig:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config.store import configs_dir, recipes_dir, register_schema

    register_schema()
    recipe = next(o.split("=", 1)[1] for o in overrides if o.startswith("recipe="))
    rest = [o for o in overrides if not o.startswith("recipe=")]
    with initialize_config_dir(str(recipes_dir()), version_base=None):
        composed = compose(recipe, overrides=[f"hydra.searchpath=[file://{configs_dir()}]", *rest])
    return OmegaConf.to_object(composed)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"placement": {"mode": "ray", "num_engines": 3}}, "must be 0 or placement.num_processes"),
        ({"placement": {"mode": "ray"}, "weight_sync": {"transport": "inprocess"}}, "cannot reach"),
        (
            {"placement": {"mode": "ray", "colocate": False}, "weight_sync": {"transport": "cuda_ipc"}},
            "colocate",
        ),
        ({"placement": {"mode": "ray"}, "rollout": {"spec_draft_train": True}}, "spec_draft_train"),
        ({"placement": {"mode": "kubernetes"}}, "use embedded"),
    ],
)
def test_ray_settings_are_checked_at_start(overrides: dict, message: str) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        OmegaConf.structured(MilesConfig), {"model": {"path": "builtin:tiny_moe_math"}}, overrides
    )
    with pytest.raises(MilesUserError, match=message):
        validate(OmegaConf.to_object(cfg))
