"""`miles train recipe=grpo_math trainer.backend=deepspeed` on CPU, 2 processes over gloo (the launcher,
or the Ray placement's actors, set up the group; nothing to set by hand): ZeRO-3 follows the torch backend's
run step for step, the engine's weights pass the sync's checksums (engines in other processes too, under
Ray), and a resume from a checkpoint (HF weights + DeepSpeed's shards) repeats step 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.models.checkpoint import iter_hf_tensors
from miles.tracking import read_records
from tests.support.cli import run_miles
from tests.support.placements import RESUMABLE_GRPO

pytest.importorskip("deepspeed")

COMMON = [*RESUMABLE_GRPO, "placement.num_processes=2"]
ZERO3 = ["trainer.backend=deepspeed", "trainer.zero_stage=3"]


@pytest.mark.slow
def test_grpo_math_with_zero3_follows_the_torch_backend_and_resumes(tmp_path: Path) -> None:
    runs = tmp_path / "outputs"
    out = run_miles(tmp_path, *COMMON, *ZERO3, run_dir=runs / "zero3")
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *COMMON, "trainer.backend=torch", run_dir=runs / "torch")
    assert out.returncode == 0, out.stderr[-3000:]
    zero, torch_run = read_records(runs / "zero3"), read_records(runs / "torch")
    assert [r["step"] for r in zero] == [1, 2]
    for mine, theirs in zip(zero, torch_run, strict=True):
        assert mine["sync/checksum_ok"] == 1.0 and mine["sync/replicas_equal"] == 1.0
        assert mine["mismatch/logprob_abs_diff_max"] < 1e-4  # engine vs the ZeRO-3 trainer's forward
        assert mine["reward/mean"] == theirs["reward/mean"]
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-3, abs=1e-6)
        assert mine["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-3)
    # the Ray placement: trainer-rank actors (their own process group) and engine actors in other processes,
    # the gathered weights sent through shared memory
    pytest.importorskip("ray")
    ray_args = ["placement=ray", "placement.cpus_per_actor=0.5", "trainer.save_every=0"]
    out = run_miles(tmp_path, *COMMON, *ZERO3, *ray_args, run_dir=runs / "ray")
    assert out.returncode == 0, out.stderr[-3000:]
    for mine, theirs in zip(read_records(runs / "ray"), zero, strict=True):
        assert mine["sync/checksum_ok"] == 1.0 and mine["reward/mean"] == theirs["reward/mean"]
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5, abs=1e-7)

    step1 = runs / "zero3" / "checkpoints" / "step_000001"
    assert (step1 / "deepspeed" / "state").is_dir()  # every rank's shards, moved in whole

    out = run_miles(tmp_path, *COMMON, *ZERO3, f"trainer.resume_from={step1}", run_dir=runs / "resumed")
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = read_records(runs / "resumed")
    for key in ("reward/mean", "train/loss", "train/grad_norm", "train/lr"):
        assert resumed[-1][key] == zero[-1][key], key
    final = dict(iter_hf_tensors(runs / "zero3" / "checkpoints" / "step_000002"))
    again = dict(iter_hf_tensors(runs / "resumed" / "checkpoints" / "step_000002"))
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
