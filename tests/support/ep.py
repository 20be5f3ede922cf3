"""Workers for tests/trainer/test_megatron_expert_parallel.py (a module of their own so spawned processes
import them)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles.distributed import DataParallel
from miles.sample import Sample
from miles.trainer.backends import build_policy, copy_policy_into
from tests.support.dp import make_trainer, scored_samples, tiny_moe


def with_routes(samples: list[Sample], seed: int = 1) -> list[Sample]:
    """Each sample with recorded experts for routing replay: 2 distinct of tiny_moe's 8 per fed token and
    layer, drawn at random (not the router's own choice, so replaying them changes the result)."""
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        s.routed_experts = (
            torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(fed * 2)])
            .view(fed, 2, 2)
            .to(torch.int16)
        )
    return samples


def sizes(case: dict) -> dict:
    return dict(
        tensor_parallel=case.get("tp", 1),
        expert_parallel=case.get("ep", 1),
        expert_tensor_parallel=case.get("etp"),
    )


def ep_worker(rank: int, world: int, store: str, case: dict, out_dir: str) -> None:
    """One rank of a megatron trainer with experts (and maybe attention) split over ranks: `steps` updates
    on its share of the samples, a checkpoint round trip, then the whole weights it gathered and its metrics."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = case.get("device") == "cuda"
    if not cuda:  # megatron's collectives run on the CPU in processes without CUDA (megatron/parallel.py)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank, on_cuda=cuda)
        model = tiny_moe().to(torch.device("cuda", rank) if cuda else "cpu")
        policy = build_policy("megatron", copy.deepcopy(model), **sizes(case))
        samples = scored_samples(case["num_samples"])
        if case.get("replay"):
            with_routes(samples)
        trainer = make_trainer(policy, case, dp)
        mine = dp.shard(samples)  # the loop's split; a TP group trains on the union of its ranks' shares
        metrics = [trainer.train_step(mine) for _ in range(case["steps"])]
        # whole tensors, kept by rank 0: every rank resumes from rank 0's as from the checkpoint it writes
        state = dp.broadcast_object(trainer.state_dict())
        current = copy.deepcopy(model)
        copy_policy_into(trainer.model, current)
        resumed = make_trainer(build_policy("megatron", current, **sizes(case)), case, dp)
        resumed.load_state_dict(copy.deepcopy(state))
        after = trainer.train_step(mine), resumed.train_step(mine)
        weights = dict(trainer.model.engine_weights())
        resumed_weights = dict(resumed.model.engine_weights())
        if rank == 0:
            save_file(
                {
                    **{f"w.{k}": v.cpu().contiguous() for k, v in weights.items()},
                    **{f"resumed.{k}": v.cpu().contiguous() for k, v in resumed_weights.items()},
                },
                str(Path(out_dir) / "rank0.safetensors"),
            )
        shapes = {k: list(v.shape) for k, v in state["tensors"].items()}
        (Path(out_dir) / f"rank{rank}.json").write_text(
            json.dumps({"metrics": metrics, "after": after, "state_shapes": shapes})
        )
        dist.barrier()  # every rank done with the group before one tears it down
    finally:
        dist.destroy_process_group()
