"""The distributed optimizer (trainer/distributed_optimizer/adamw.py) against the replicated AdamW, over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from miles.config import TrainerConfig
from miles.distributed import SINGLE
from miles.errors import MilesUserError
from tests.support.sharded import (
    case_steps,
    checkpoint_worker,
    resume_step,
    sharded_case_model,
    sharded_case_trainer,
    sharded_worker,
    split_worker,
)

CASES = {
    # a tiny MoE (experts no token of a rank reaches), a step without loss tokens (skipped), clipping on
    "moe_fp32_skip": {"num_experts": 8, "empty_steps": [1]},
    # dense, bf16 weights: float32 master shards, rounded into the weights by the all-gather
    "dense_bf16": {"num_experts": 0, "dtype": "bfloat16"},
}


def _run(tmp_path: Path, case: dict, distributed: bool) -> tuple[list[dict], list[dict]]:
    out = tmp_path / ("sharded" if distributed else "replicated")
    out.mkdir()
    case = {**case, "distributed": distributed}
    mp.start_processes(
        sharded_worker, args=(2, str(out / "store"), case, str(out)), nprocs=2, start_method="spawn"
    )
    weights = [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]
    metrics = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return weights, metrics


@pytest.mark.parametrize("name", list(CASES))
def test_distributed_optimizer_equals_replicated_adamw(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    want_w, want_m = _run(tmp_path, case, distributed=False)
    got_w, got_m = _run(tmp_path, case, distributed=True)
    initial = sharded_case_model(case).state_dict()
    for key, want in want_w[0].items():
        assert not torch.equal(want, initial[key]) or "norm" in key, key  # the update moved it
        for rank in range(2):
            torch.testing.assert_close(got_w[rank][key].float(), want.float(), atol=1e-6, rtol=0)
    assert torch.equal(got_w[0]["lm_head.weight"], got_w[1]["lm_head.weight"])  # replicas stay identical
    for got, want in zip(got_m[0], want_m[0]):
        assert got["train/skipped_steps"] == want["train/skipped_steps"]
        assert got["train/lr"] == want["train/lr"]
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-6, abs=1e-6)
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6, abs=1e-6)
    assert sum(m["train/skipped_steps"] for m in want_m[0]) == len(case.get("empty_steps", []))
    assert max(m["train/grad_norm"] for m in want_m[0]) > 0.05  # clipping took part


def test_one_process_distributed_optimizer_equals_adamw() -> None:
    case = {"num_experts": 8, "empty_steps": [1]}
    models = [sharded_case_model(case) for _ in range(2)]
    trainers = [sharded_case_trainer(m, case, SINGLE, distributed) for m, distributed in zip(models, (0, 1))]
    for step in range(3):
        want, got = (t.train_step(case_steps(case, step)) for t in trainers)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-6)
    for (key, want), got in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=key)
    # nothing of the replicated AdamW's state is kept beside the shards
    assert not trainers[1].optimizer.state and trainers[1].masters is None


def test_distributed_optimizer_checkpoint_kind_is_checked() -> None:
    case = {"num_experts": 0}
    replicated = sharded_case_trainer(sharded_case_model(case), case, SINGLE, False)
    sharded = sharded_case_trainer(sharded_case_model(case), case, SINGLE, True)
    with pytest.raises(MilesUserError, match="distributed_optimizer=true"):
        replicated.load_state_dict(sharded.state_dict())
    with pytest.raises(MilesUserError, match="distributed_optimizer=false"):
        sharded.load_state_dict(replicated.state_dict())
    other = sharded_case_trainer(sharded_case_model({"num_experts": 4}), case, SINGLE, True)
    with pytest.raises(MilesUserError, match="layout differs"):
        other.load_state_dict(sharded.state_dict())
    assert TrainerConfig().distributed_optimizer is False


def test_sharded_checkpoint_resumes_into_the_same_run(tmp_path: Path) -> None:
    """Each of 2 ranks writes its shards (torch.distributed.checkpoint); a fresh 2-rank trainer resumed
    from them repeats the next update bit for bit, and one process (another data-parallel size) resumes
    from them too, to float rounding."""
    case = {"num_experts": 8, "save_after": 2, "steps": 3}
    mp.start_processes(
        checkpoint_worker,
        args=(2, str(tmp_path / "store"), case, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in (folder / "optimizer_shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # one file a rank: nothing gathered to rank 0
    assert not list((tmp_path / "checkpoints").glob(".optimizer_shards_*"))  # the staging folder moved
    uninterrupted = load_file(str(tmp_path / "uninterrupted.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    for key, want in uninterrupted.items():
        assert torch.equal(resumed[key], want), key
    meta = json.loads((folder / "meta.json").read_text())
    single = resume_step(case, SINGLE, folder, meta)
    for key, got in single.state_dict().items():
        torch.testing.assert_close(got, uninterrupted[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow
def test_miles_train_with_the_distributed_optimizer_resumes_on_another_process_count(tmp_path: Path) -> None:
    """`miles train` on 2 processes with the distributed optimizer, full recomputation and offload writes its shards
    into each checkpoint; one process resumes from step 1 and repeats step 2 (to float rounding: the
    gradients sum in another order)."""
    from tests.support.cli import run_miles
    from tests.support.placements import RESUMABLE_GRPO

    common = [
        *RESUMABLE_GRPO,
        "trainer.distributed_optimizer=true",
        "trainer.recompute=full",
        "trainer.offload_optimizer_during_rollout=true",  # a no-op without CUDA, logged as 0
        "rollout.release_kv_during_train=true",
    ]
    two, one = tmp_path / "two", tmp_path / "one"
    out = run_miles(tmp_path, *common, "placement.num_processes=2", run_dir=two)
    assert out.returncode == 0, out.stderr[-3000:]
    shards = two / "checkpoints" / "step_000001" / "optimizer_shards"
    assert {p.name for p in shards.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    resume = f"trainer.resume_from={two / 'checkpoints' / 'step_000001'}"
    out = run_miles(tmp_path, *common, resume, run_dir=one)
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = (json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (two, one))
    assert got["step"] == want["step"] == 2
    assert got["reward/mean"] == want["reward/mean"]
    assert got["time/offload"] == want["time/offload"] == 0.0
    for key in ("train/loss", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    out = run_miles(tmp_path, *common, resume, "trainer.distributed_optimizer=false", run_dir=tmp_path / "x")
    assert out.returncode != 0 and "trainer.distributed_optimizer=true" in out.stderr


SPLIT_CASES = {
    # experts over 2 ranks of 4: expert weights sliced over their expert-data-parallel pairs, the rest over 4
    "ep2_of_4": {"world": 4, "ep": 2},
    # tensor parallelism: each TP rank slices its parts over its replicas' group; split norms add over TP
    "tp2_of_4": {"world": 4, "tp": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_distributed_optimizer_on_split_megatron_equals_replicated(name: str, tmp_path: Path) -> None:
    case = {**SPLIT_CASES[name], "steps": 2, "global_batch_size": 8}
    results = []
    for distributed in (False, True):
        out = tmp_path / str(distributed)
        out.mkdir()
        world = case["world"]
        args = (world, str(out / "store"), {**case, "distributed": distributed}, str(out))
        mp.start_processes(split_worker, args=args, nprocs=world, start_method="spawn")
        results.append(
            (load_file(str(out / "rank0.safetensors")), json.loads((out / "rank0.json").read_text()))
        )
    (want_w, want_m), (got_w, got_m) = results
    for key, want in want_w.items():
        torch.testing.assert_close(got_w[key], want, atol=1e-6, rtol=0, msg=key)
    for got, want in zip(got_m, want_m):
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-6)
    # each rank's shards (keyed by process), resumed by a fresh split trainer, repeat the next step exactly
    reports = [json.loads((tmp_path / "True" / f"resume{r}.json").read_text()) for r in range(case["world"])]
    assert all(r["resumed_equal"] for r in reports)
    assert reports[0]["split"]  # some parameters are split, so their norms sum over their parts group
    if "ep" in case:  # experts reduce over their own (expert-data-parallel) group
        assert reports[0]["groups"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distributed_optimizer_on_cuda_equals_fused_adamw() -> None:
    """On CUDA both run torch's fused AdamW kernel: the shards' update equals the replicated one."""
    case = {"num_experts": 8, "dtype": "bfloat16", "empty_steps": [1]}
    models = [sharded_case_model(case).cuda() for _ in range(2)]
    trainers = [sharded_case_trainer(m, case, SINGLE, distributed) for m, distributed in zip(models, (0, 1))]
    for step in range(3):
        want, got = (t.train_step(case_steps(case, step)) for t in trainers)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    for (key, want), got in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=0, msg=key)
