"""The colocated memory plan (trainer/offload.py): optimizer offload between updates, the peak-memory metrics,
and the settings refused at start."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.config import AlgorithmConfig, MilesConfig, TrainerConfig
from miles.distributed import combine_metrics
from miles.errors import MilesUserError
from miles.rl.trainer_side import TrainerSide
from miles.trainer import PolicyTrainer
from miles.trainer.offload import OptimizerOffload, PeakMemory, check_memory_plan
from tests.support.dp import scored_samples
from tests.support.trainer import tiny_model


def _trainer(device: str, distributed: bool, offload: bool) -> PolicyTrainer:
    model = tiny_model(seed=4, num_experts=4).to(device=device, dtype=torch.bfloat16)
    cfg = TrainerConfig(
        global_batch_size=8,
        micro_batch_tokens=24,
        distributed_optimizer=distributed,
        offload_optimizer_during_rollout=offload,
        lr=1e-2,
    )
    return PolicyTrainer(model, cfg, AlgorithmConfig(), temperature=1.0)


def test_offload_on_cpu_is_a_no_op_that_reports_zero() -> None:
    trainer = _trainer("cpu", distributed=True, offload=True)
    side = TrainerSide(trainer)
    assert not side.offload.enabled and side.offload.state_bytes() > 0
    timings: dict[str, float] = {}
    metrics = side.train([], scored_samples(8), True, timings)
    assert metrics["train/optimizer_steps"] == 1.0
    assert timings["time/offload"] == 0.0
    assert not any(k.startswith("memory/") for k in timings)  # no CUDA: no device peaks to report
    off = TrainerSide(_trainer("cpu", distributed=True, offload=False))
    timings = {}
    off.train([], scored_samples(8), True, timings)
    assert "time/offload" not in timings  # only reported when asked for


def test_peak_memory_of_several_ranks_takes_the_largest() -> None:
    per_rank = [
        {"memory/peak_update_gb": 3.0, "memory/rank0/peak_update_gb": 3.0},
        {"memory/peak_update_gb": 5.0, "memory/rank1/peak_update_gb": 5.0},
    ]
    combined = combine_metrics(per_rank, [1.0, 1.0])
    assert combined == {
        "memory/peak_update_gb": 5.0,
        "memory/rank0/peak_update_gb": 3.0,
        "memory/rank1/peak_update_gb": 5.0,
    }
    assert PeakMemory(torch.device("cpu"), 0, 2).read("update") == {}


def test_memory_plan_settings_refused_at_start() -> None:
    cfg = MilesConfig()
    cfg.trainer.offload_optimizer_during_rollout = True
    with pytest.raises(MilesUserError, match="release_kv_during_train=true"):
        check_memory_plan(cfg)
    cfg.rollout.release_kv_during_train = True
    check_memory_plan(cfg)
    cfg.placement.mode = "ray"
    with pytest.raises(MilesUserError, match="placement.mode=ray"):
        check_memory_plan(cfg)
    cfg = MilesConfig()
    cfg.trainer.distributed_optimizer, cfg.trainer.backend = True, "deepspeed"
    with pytest.raises(MilesUserError, match="DeepSpeed shards its own"):
        check_memory_plan(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_offload_moves_the_state_out_between_updates_and_trains_the_same(distributed: bool) -> None:
    plain, offloaded = _trainer("cuda", distributed, False), _trainer("cuda", distributed, True)
    side = TrainerSide(offloaded)
    for _ in range(2):
        timings: dict[str, float] = {}
        plain.train_step(copy.deepcopy(scored_samples(8)))
        side.train([], copy.deepcopy(scored_samples(8)), True, timings)
        assert timings["time/offload"] > 0
        assert timings["memory/peak_update_gb"] > 0 and "memory/peak_rollout_gb" in timings
        state = side.offload.state_tensors()
        assert state and all(t.device.type == "cpu" and t.is_pinned() for t in state)
    for (name, want), got in zip(plain.model.state_dict().items(), offloaded.model.state_dict().values()):
        assert torch.equal(got, want), name
    # nothing held back from the KV pool: the update takes the memory the pool gives back
    assert side.memory_reserve_bytes() == 0 < offloaded.memory_reserve_bytes()
    assert OptimizerOffload(offloaded, True).enabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_an_offloaded_trainer_resumes_into_the_same_run(distributed: bool, tmp_path) -> None:
    """A checkpoint loaded while the state sits on the host (the trainer side offloads it when built)."""
    from miles.distributed import SINGLE
    from miles.rl.sharded_checkpoint import load_optimizer_shards, move_into, save_optimizer_shards

    first = _trainer("cuda", distributed, True)
    side = TrainerSide(first)
    side.train([], scored_samples(8), True, {})
    state = copy.deepcopy(first.state_dict())
    folder = tmp_path / "checkpoint"
    if distributed:
        folder.mkdir()
        move_into(save_optimizer_shards(first.sharded, tmp_path / "checkpoints", 1, SINGLE), folder)
    fresh = _trainer("cuda", distributed, True)
    fresh.model.load_state_dict(first.model.state_dict())
    resumed = TrainerSide(fresh)
    fresh.load_state_dict(state)
    if distributed:
        load_optimizer_shards(fresh.sharded, folder, state["meta"]["distributed_optimizer"], SINGLE)
    for each in (side, resumed):
        each.train([], scored_samples(8, seed=1), True, {})
    for (name, want), got in zip(first.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(got, want), name


def test_memory_plan_bench_runs_every_variant_on_one_update(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from miles.bench.memory_plan import main

    args = "--model tiny --arch qwen3_moe --samples 4 --prompt-len 8 --response-len 8 --steps 1"
    assert main([*args.split(), "--variants", "replicated,distributed+full+offload"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    replicated, distributed = report["results"]
    assert distributed["first_loss"] == pytest.approx(replicated["first_loss"], abs=1e-6)
    assert distributed["first_grad_norm"] == pytest.approx(replicated["first_grad_norm"], rel=1e-5)
    assert distributed["optimizer_state_gb"] == pytest.approx(replicated["optimizer_state_gb"], rel=0.01)
