"""Megatron expert parallelism, expert tensor parallelism and tensor parallelism of MoE layers on CPU (gloo).

Each case splits a tiny MoE (8 experts, top 2) over 2 or 4 processes, each passing the loop's share of the
samples; compared with the `torch` backend in one process on the whole batch: the update's loss and gradient
norm (1e-4), the gathered weights after it (1e-5), and a resume from the whole-tensor checkpoint, which
repeats the next step bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from miles.distributed import SINGLE
from miles.errors import MilesUserError
from miles.trainer.backends import build_policy
from miles.trainer.megatron.layout import expert_shard, expert_unshard
from tests.support.dp import make_trainer, scored_samples, tiny_moe
from tests.support.ep import ep_worker, with_routes

pytest.importorskip("megatron.core")

CASES = {
    "ep2": {"world": 2, "ep": 2},
    "ep2_dp2": {"world": 4, "ep": 2},
    "tp2_moe": {"world": 2, "tp": 2},  # expert-TP = TP (megatron's default): each expert's slice per rank
    "tp2_ep2_etp1": {"world": 2, "tp": 2, "ep": 2, "etp": 1},
    # routing replay: random recorded experts (not the routers' choice), replayed as the torch backend does
    "ep2_replay": {"world": 2, "ep": 2, "replay": True},
    "tp2_replay": {"world": 2, "tp": 2, "replay": True},
}


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in ("train/tokens_per_s", "train/mfu")}


@pytest.mark.parametrize("name", list(CASES))
def test_split_experts_update_equals_one_process(name: str, tmp_path: Path) -> None:
    _check_against_one_process(CASES[name], tmp_path)


GPU_CASES = {
    "ep2": {"world": 2, "ep": 2},
    "etp2": {"world": 2, "etp": 2},  # expert-TP over ranks with different tokens: NCCL's uneven all-gather
    "ep2_replay": {"world": 2, "ep": 2, "replay": True},
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_split_experts_on_two_gpus_equal_one_process(name: str, tmp_path: Path) -> None:
    """The same over NCCL on 2 GPUs (float32), against one CPU process of the torch backend."""
    _check_against_one_process({**GPU_CASES[name], "device": "cuda"}, tmp_path)


def _check_against_one_process(split: dict, tmp_path: Path) -> None:
    # AdamW's first steps move a weight by about lr * sign(g): where g is ~0 up to the order of float additions
    # (another reduction order here) it moves a little more or less. lr 1e-3 and eps 1e-6 keep that under the
    # 1e-5 compared (scale errors do not show in the weights; train/grad_norm compares them).
    case = {"eps": 1e-6, "lr": 1e-3, "steps": 1, "global_batch_size": 6, "num_samples": 12}
    case["loss_agg"] = "token_mean"
    case.update(split)
    world = case["world"]
    mp.start_processes(
        ep_worker,
        args=(world, str(tmp_path / "store"), case, str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    model = tiny_moe()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(model, case, SINGLE)
    samples = scored_samples(case["num_samples"])
    if case.get("replay"):
        with_routes(samples)
    expected = [trainer.train_step(samples) for _ in range(case["steps"] + 1)]

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in reports[1:]:  # every rank reports the batch's (timings aside)
        assert [_untimed(m) for m in r["metrics"]] == [_untimed(m) for m in reports[0]["metrics"]]
    for step, (mine, theirs) in enumerate(zip(reports[0]["metrics"] + [reports[0]["after"][0]], expected)):
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (step, key)
    assert _untimed(reports[0]["after"][1]) == _untimed(reports[0]["after"][0])  # resumed: bit for bit
    got = load_file(str(tmp_path / "rank0.safetensors"))
    moved = 0.0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[f"w.{key}"], value, rtol=0, atol=1e-5, msg=key)
        assert torch.equal(got[f"resumed.{key}"], got[f"w.{key}"]), key
        moved = max(moved, (value - start[key]).abs().max().item())
    assert moved > 1e-3
    shapes = reports[0]["state_shapes"]  # checkpoints hold whole experts, whatever the split
    assert shapes["optimizer.gpt.decoder.layers.0.mlp.experts.weight1.exp_avg"] == [8, 32, 32]
    assert shapes["optimizer.gpt.decoder.layers.1.mlp.experts.weight2.exp_avg_sq"] == [8, 32, 16]


def test_expert_shards_put_back_together() -> None:
    whole = torch.randn(8, 32, 32)
    name = "decoder.layers.0.mlp.experts.weight1"
    parts = {(e, t): expert_shard(name, whole, e, 2, t, 2) for e in range(2) for t in range(2)}
    assert parts[(1, 0)].shape == (4, 16, 32)
    assert torch.equal(parts[(1, 1)][:, :8], whole[4:, 8:16])  # [gate slice; up slice] of experts 4..7
    assert torch.equal(parts[(1, 1)][:, 8:], whole[4:, 24:32])
    assert torch.equal(expert_unshard(name, parts, 2, 2), whole)
    down = torch.randn(8, 32, 16)
    name = "decoder.layers.0.mlp.experts.weight2"
    parts = {(e, t): expert_shard(name, down, e, 2, t, 2) for e in range(2) for t in range(2)}
    assert torch.equal(parts[(0, 1)], down[:4, :, 8:])
    assert torch.equal(expert_unshard(name, parts, 2, 2), down)


def test_layouts_that_cannot_split_fail_at_start_with_what_to_do() -> None:
    from miles.trainer.megatron.parallel import ParallelSizes, check_parallel_sizes

    args = tiny_moe().args
    with pytest.raises(MilesUserError, match="must divide the model's 8 experts"):
        check_parallel_sizes(args, 6, ParallelSizes(expert=3))
    with pytest.raises(MilesUserError, match="must divide the 2 processes"):
        check_parallel_sizes(args, 2, ParallelSizes(expert=2, expert_tensor=2))
    with pytest.raises(MilesUserError, match="intermediate size 16"):
        check_parallel_sizes(args, 3, ParallelSizes(expert_tensor=3))
    with pytest.raises(MilesUserError, match="this model is dense"):
        check_parallel_sizes(tiny_moe().args.__class__(model_type="qwen3"), 2, ParallelSizes(expert=2))
    with pytest.raises(MilesUserError, match="need trainer.backend=megatron"):
        build_policy("torch", tiny_moe(), expert_parallel=2)
    from miles.trainer.megatron.parallel import install_cpu_collectives

    with pytest.raises(MilesUserError, match="gloo has no all-gather of uneven parts"):
        with pytest.MonkeyPatch.context() as patch:  # as in a process without CUDA
            patch.setattr(torch.cuda, "is_available", lambda: False)
            install_cpu_collectives(torch.device("cpu"), ParallelSizes(expert=2, expert_tensor=2))


@pytest.mark.slow
def test_grpo_with_expert_parallel_follows_data_parallel_and_resumes_at_any_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the shipped tiny MoE (4 experts): EP=2 over 2 processes against 2 data-parallel processes
    from miles.tracking import read_records
    from tests.support.cli import run_miles
    from tests.trainer.test_megatron import COMMON

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU processes (trainer/megatron/parallel.py)
    common = [*COMMON, "trainer.backend=megatron", "placement.num_processes=2", "algorithm.entropy_coef=0.01"]
    runs = tmp_path / "runs"
    for name, extra in {
        "ep2": ["trainer.expert_parallel_size=2"],
        "dp2": [],
        "dp2_from_ep2": [f"trainer.resume_from={runs / 'ep2'}/checkpoints/step_000001"],
    }.items():
        out = run_miles(tmp_path, *common, *extra, run_dir=runs / name)
        assert out.returncode == 0, out.stderr[-3000:]
    ep2, dp2 = read_records(runs / "ep2"), read_records(runs / "dp2")
    for mine, theirs in zip(ep2, dp2, strict=True):
        assert mine["sync/checksum_ok"] == mine["sync/replicas_equal"] == 1.0
        assert mine["mismatch/logprob_abs_diff_max"] < 1e-5  # the engine's model vs the expert-split megatron
        assert mine["reward/mean"] == theirs["reward/mean"]
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4), key  # the 1e-4
    switched = read_records(runs / "dp2_from_ep2")[-1]  # the checkpoint holds whole experts
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert switched[key] == pytest.approx(ep2[-1][key], rel=1e-4), key
