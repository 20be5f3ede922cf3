"""Dynamic sampling (`algorithm.group_filter`, trainer/group_filter.py): the filter, the metrics of a step's
batches, and the loop topping a step up with further batches of prompts (one process and two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.errors import MilesUserError
from miles.sample import Sample, SampleStatus
from miles.trainer.group_filter import combine_round_metrics, kept_groups, load_group_filter, nonzero_std
from tests.support.cli import run_miles


def scored(group_id: int, rewards: list[float], aborted: tuple[int, ...] = ()) -> list[Sample]:
    return [
        Sample(
            prompt="p",
            group_id=group_id,
            index=i,
            response_ids=[] if i in aborted else [1, 2],
            status=SampleStatus.ABORTED if i in aborted else SampleStatus.COMPLETED,
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_nonzero_std_keeps_groups_whose_trainable_rewards_differ() -> None:
    assert nonzero_std(scored(0, [1.0, 0.0, 1.0]))
    assert not nonzero_std(scored(0, [1.0, 1.0, 1.0]))
    assert not nonzero_std(scored(0, [0.0, 0.0]))
    # An aborted sample (reward 0, no response) trains on nothing: it does not make a group informative.
    assert not nonzero_std(scored(0, [1.0, 0.0, 1.0], aborted=(1,)))
    samples = scored(5, [1.0, 1.0]) + scored(2, [0.0, 1.0]) + scored(9, [0.5, 0.0])
    assert kept_groups(list(reversed(samples)), nonzero_std) == [9, 2]  # order of first appearance


def test_a_filter_sees_one_group_in_index_order_and_must_return_a_bool() -> None:
    seen: list[list[int]] = []

    def record(group: list[Sample]) -> bool:
        seen.append([s.index for s in group])
        return group[0].group_id == 1

    samples = scored(0, [1.0, 0.0, 0.5]) + scored(1, [0.0, 1.0])
    assert kept_groups(list(reversed(samples)), record) == [1]
    assert seen == [[0, 1], [0, 1, 2]]
    with pytest.raises(TypeError, match="must return True"):
        kept_groups(samples, lambda group: None)  # type: ignore[arg-type,return-value]


def test_group_filter_specs(tmp_path: Path) -> None:
    assert load_group_filter("") is None
    assert load_group_filter(" nonzero_std ") is nonzero_std
    plugin = tmp_path / "my_filter.py"
    plugin.write_text("def short(group):\n    return len(group) < 3\n")
    fn = load_group_filter(f"{plugin}:short")
    assert fn is not None and fn(scored(0, [1.0])) and not fn(scored(0, [1.0] * 3))
    with pytest.raises(MilesUserError, match="built-in"):
        load_group_filter("nonzero-std")
    with pytest.raises(MilesUserError, match="has no 'missing'"):
        load_group_filter(f"{plugin}:missing")


def test_the_reward_metrics_of_a_step_s_batches_combine_as_one_batch() -> None:
    first = {"reward/mean": 1.0, "reward/std": 0.0, "reward/errors": 1.0, "reward/worker_restarts": 2.0}
    second = {"reward/mean": 0.0, "reward/std": 0.0, "reward/errors": 2.0, "reward/worker_restarts": 3.0}
    merged = combine_round_metrics([(first, 3.0), (second, 1.0)])
    assert merged["reward/mean"] == pytest.approx(0.75)
    assert merged["reward/std"] == pytest.approx((0.75 * 0.25) ** 0.5)  # pooled: 3 ones and a zero
    assert merged["reward/errors"] == 3.0
    assert merged["reward/worker_restarts"] == 3.0  # a count over the run: the last batch's
    assert combine_round_metrics([(first, 3.0)]) == first


FILTER = """
import json, os

def every_third(group):
    # Writes what it saw, then keeps groups 0, 3, 6, ...: 2 of the first batch of 4, 1 of each next.
    assert [s.index for s in group] == list(range(len(group)))
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps([group[0].group_id, len(group), [s.reward for s in group]]) + "\\n")
    return group[0].group_id % 3 == 0
"""


def run_filtered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, *overrides: str
) -> tuple[list[dict], list[list]]:
    plugin = tmp_path / "every_third.py"
    plugin.write_text(FILTER)
    seen = tmp_path / f"{name}.seen"
    monkeypatch.setenv("SEEN", str(seen))  # run_miles passes the environment to the run's processes
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=16",
        f"algorithm.group_filter={plugin}:every_third",
        *overrides,
        run_dir=tmp_path / name,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, [json.loads(line) for line in seen.read_text().splitlines()]


def test_the_loop_generates_batches_until_the_filter_kept_a_step_s_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records, seen = run_filtered(tmp_path, monkeypatch, "one")
    (step,) = records
    # Batch 1: groups 0-3 (keeps 0, 3), batch 2: 4-7 (6), batch 3: 8-11 (9): four kept in three batches.
    assert sorted(g for g, _, _ in seen) == list(range(12))
    assert all(size == 4 for _, size, _ in seen)
    assert step["rollout/filter_batches"] == 3 and step["rollout/filter_kept_groups"] == 4
    assert step["rollout/filter_dropped_frac"] == pytest.approx(8 / 12)
    assert step["adv/num_groups"] == 4  # the update trains on the kept groups only
    rewards = [r for _, _, group in seen for r in group]
    assert step["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))  # over all that was generated

    records, seen = run_filtered(tmp_path, monkeypatch, "capped", "algorithm.filter_max_batches=2")
    (step,) = records
    assert step["rollout/filter_batches"] == 2 and step["rollout/filter_kept_groups"] == 3
    assert step["adv/num_groups"] == 3  # short of four after two batches: it trains on those


@pytest.mark.slow
def test_two_processes_filter_the_whole_batch_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank generates half of each batch's groups; the filter runs on every rank's samples, so both
    ranks stop after the same batch and train on the same groups."""
    records, seen = run_filtered(tmp_path, monkeypatch, "two", "placement.num_processes=2")
    (step,) = records
    assert step["rollout/filter_batches"] == 3 and step["rollout/filter_kept_groups"] == 4
    assert step["adv/num_groups"] == 4
    assert all(size == 4 for _, size, _ in seen)  # whole groups, both ranks' samples
    assert sorted(g for g, _, _ in seen) == sorted(list(range(12)) * 2)  # each rank filtered every group


def test_the_overlong_penalty_grows_over_the_buffer() -> None:
    from miles.trainer.overlong import apply_overlong_penalty, overlong_penalty

    assert [overlong_penalty(n, 20, 4, 1.0) for n in (0, 16, 17, 18, 20, 25)] == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
        -1.0,
    ]
    assert overlong_penalty(19, 20, 4, 0.5) == -0.375
    samples = scored(0, [1.0, 1.0, 0.0])
    for sample, length in zip(samples, (10, 18, 20)):
        sample.response_ids = [1] * length
    metrics = apply_overlong_penalty(samples, 20, 4, 1.0)
    assert [s.reward for s in samples] == [1.0, 0.5, -1.0]
    assert [s.reward_info["overlong_penalty"] for s in samples] == [0.0, -0.5, -1.0]
    assert metrics == {
        "reward/overlong_penalty_mean": pytest.approx(-0.5),
        "reward/overlong_frac": pytest.approx(2 / 3),
    }


def test_the_loop_penalises_long_responses_after_the_filter_judged_them(tmp_path: Path) -> None:
    """grpo_math's responses end well inside 24 tokens; a buffer of 20 puts most of them in the penalty:
    the advantages see it (the filter, as scored, does not)."""
    plain = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=4",
        "algorithm=dapo",
        "algorithm.overlong_buffer=20",
        run_dir=tmp_path / "shaped",
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    (step,) = [json.loads(line) for line in (tmp_path / "shaped" / "metrics.jsonl").read_text().splitlines()]
    assert step["reward/overlong_frac"] > 0.5 and step["reward/overlong_penalty_mean"] < 0
    assert step["rollout/filter_kept_groups"] == 4
