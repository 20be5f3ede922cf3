"""Workers for tests/trainer/test_sharded_optimizer.py (a module of their own so spawned processes import them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.distributed import DataParallel
from miles.models import CausalLM
from miles.trainer import PolicyTrainer
from tests.support.dp import scored_samples
from tests.support.trainer import tiny_model


def sharded_case_model(case: dict) -> CausalLM:
    model = tiny_model(seed=1, num_experts=case.get("num_experts", 8))
    return model.to(getattr(torch, case.get("dtype", "float32")))


def sharded_case_trainer(model: CausalLM, case: dict, dp: DataParallel, distributed: bool) -> PolicyTrainer:
    cfg = TrainerConfig(
        global_batch_size=case.get("global_batch_size", 8),
        micro_batch_tokens=24,
        optim=OptimConfig(
            grad_clip=case.get("grad_clip", 0.05),
            weight_decay=0.01,
            warmup_steps=2,
            schedule="cosine",
            min_lr_ratio=0.1,
        ),
        lr=1e-2,
        max_steps=case.get("steps", 3),
        distributed_optimizer=distributed,
    )
    algorithm = AlgorithmConfig(loss_agg="token_mean", entropy_coef=0.01)
    return PolicyTrainer(model, cfg, algorithm, temperature=1.0, dp=dp)


def case_steps(case: dict, step: int) -> list:
    """The step's samples; a step listed in `empty_steps` has no loss token (the update is skipped)."""
    samples = scored_samples(case.get("num_samples", 8), seed=step)
    if step in case.get("empty_steps", ()):
        for s in samples:
            s.loss_mask = [0] * len(s.response_ids)
    return samples


def sharded_worker(rank: int, world: int, store: str, case: dict, out_dir: str) -> None:
    """One rank: `steps` RL updates on its share, with the replicated or the distributed AdamW."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        model = sharded_case_model(case)
        trainer = sharded_case_trainer(model, case, dp, case["distributed"])
        metrics = [trainer.train_step(dp.shard(case_steps(case, i))) for i in range(case.get("steps", 3))]
        out = Path(out_dir)
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            str(out / f"rank{rank}.safetensors"),
        )
        (out / f"rank{rank}.json").write_text(json.dumps(metrics))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def resume_step(case: dict, dp: DataParallel, folder: Path, meta: dict) -> CausalLM:
    """A fresh trainer resumed from `folder` (its weights, `meta` and the optimizer shards) takes the step
    after the checkpoint's; returns its model."""
    from safetensors.torch import load_file

    from miles.rl.sharded_checkpoint import load_optimizer_shards

    model = sharded_case_model(case)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    trainer = sharded_case_trainer(model, case, dp, True)
    trainer.load_state_dict({"tensors": {}, "meta": meta})
    load_optimizer_shards(trainer.sharded, folder, meta["distributed_optimizer"], dp)
    trainer.train_step(dp.shard(case_steps(case, case["save_after"])))
    return model


def checkpoint_worker(rank: int, world: int, store: str, case: dict, out_dir: str) -> None:
    """`save_after` steps, the distributed optimizer's checkpoint, one more step (the uninterrupted run);
    then a fresh trainer resumed from the checkpoint takes that step again."""
    import torch.distributed as dist

    from miles.rl.sharded_checkpoint import move_into, save_optimizer_shards

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        out = Path(out_dir)
        model = sharded_case_model(case)
        trainer = sharded_case_trainer(model, case, dp, True)
        for i in range(case["save_after"]):
            trainer.train_step(dp.shard(case_steps(case, i)))
        folder = out / "checkpoint"
        staging = save_optimizer_shards(trainer.sharded, out / "checkpoints", case["save_after"], dp)
        meta = trainer.state_dict()["meta"]
        if dp.is_main:
            folder.mkdir()
            move_into(staging, folder)
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors")
            )
            (folder / "meta.json").write_text(json.dumps(meta))
        dp.barrier()
        trainer.train_step(dp.shard(case_steps(case, case["save_after"])))
        resumed = resume_step(case, dp, folder, meta)
        if dp.is_main:
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()},
                str(out / "uninterrupted.safetensors"),
            )
            save_file(
                {k: v.contiguous() for k, v in resumed.state_dict().items()}, str(out / "resumed.safetensors")
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def split_worker(rank: int, world: int, store: str, case: dict, out_dir: str) -> None:
    """One rank of a megatron trainer split over ranks (TP / EP, `tests.support.ep.sizes`), with the
    replicated or the distributed AdamW: `steps` updates, then the whole weights (rank 0) and metrics."""
    import copy

    import torch.distributed as dist

    from miles.trainer.backends import build_policy
    from tests.support.dp import tiny_moe
    from tests.support.ep import sizes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        policy = build_policy("megatron", copy.deepcopy(tiny_moe()), **sizes(case))
        trainer = sharded_case_trainer(policy, case, dp, case["distributed"])
        steps = case.get("steps", 2)
        metrics = [trainer.train_step(dp.shard(case_steps(case, i))) for i in range(steps)]
        weights = dict(trainer.model.engine_weights())
        out = Path(out_dir)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "rank0.safetensors"))
            (out / "rank0.json").write_text(json.dumps(metrics))
        if case["distributed"]:  # the shards' round trip: a fresh split trainer repeats the next step
            from miles.rl.sharded_checkpoint import load_optimizer_shards, move_into, save_optimizer_shards
            from miles.trainer.backends import copy_policy_into

            staging = save_optimizer_shards(trainer.sharded, out / "checkpoints", steps, dp)
            folder = out / "checkpoint"
            if rank == 0:
                folder.mkdir()
                move_into(staging, folder)
            dp.barrier()
            meta = trainer.state_dict()["meta"]
            current = tiny_moe()
            copy_policy_into(trainer.model, current)
            resumed = sharded_case_trainer(build_policy("megatron", current, **sizes(case)), case, dp, True)
            resumed.load_state_dict({"tensors": {}, "meta": meta})
            load_optimizer_shards(resumed.sharded, folder, meta["distributed_optimizer"], dp)
            for each in (trainer, resumed):
                each.train_step(dp.shard(case_steps(case, steps)))
            pairs = zip(trainer.model.engine_weights(), resumed.model.engine_weights())
            same = all(torch.equal(a, b) for (_, a), (_, b) in pairs)
            groups = len({id(b.group.group) for b in trainer.sharded.buckets})
            split = any(b.parts is not None for b in trainer.sharded.buckets)
            report = {"resumed_equal": same, "groups": groups, "split": split}
            (out / f"resume{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()
