"""Workers for tests/miles/test_distributed.py, in a module of their own so spawned processes can import them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.distributed import DataParallel
from miles.models import CausalLM
from miles.sample import Sample
from miles.trainer import PolicyTrainer
from tests.support.trainer import VOCAB, tiny_model


def tiny_moe(seed: int = 0) -> CausalLM:
    # 8 experts, top 2: with few tokens some experts see none on a rank, so their grads are None there
    return tiny_model(seed, num_experts=8)


def scored_samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt_len = int(torch.randint(2, 7, (1,), generator=g))
        response_len = int(torch.randint(1, 7, (1,), generator=g))
        response = torch.randint(0, VOCAB, (response_len,), generator=g).tolist()
        mask = [1] * response_len
        if response_len > 2 and i % 3 == 0:
            mask[1] = 0  # a masked token (environment output in a multi-turn sample)
        samples.append(
            Sample(
                prompt_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist(),
                response_ids=response,
                loss_mask=mask,
                rollout_logprobs=(-torch.rand(response_len, generator=g) * 3).tolist(),
                advantage=float(torch.randn((), generator=g)),
                group_id=i // 2,
                index=i % 2,
            )
        )
    return samples


def make_trainer(model: CausalLM, case: dict, dp: DataParallel) -> PolicyTrainer:
    cfg = TrainerConfig(
        global_batch_size=case["global_batch_size"],
        micro_batch_tokens=case.get("micro_batch_tokens", 24),
        epochs_per_rollout=case.get("epochs", 1),
        optim=OptimConfig(grad_clip=1.0, weight_decay=0.01, eps=case.get("eps", 1e-8)),
        lr=case.get("lr", 1e-2),
        routing_replay=case.get("replay", False),
    )
    algorithm = AlgorithmConfig(loss_agg=case["loss_agg"], tis=case.get("tis", False), entropy_coef=0.01)
    return PolicyTrainer(model, cfg, algorithm, temperature=1.0, dp=dp)


def train_worker(rank: int, world: int, port: int, case: dict, out_dir: str) -> None:
    """One rank of a data-parallel trainer: its shard of the samples, then its weights and metrics."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        model = tiny_moe().to(getattr(torch, case.get("dtype", "float32")))
        trainer = make_trainer(model, case, dp)
        samples = scored_samples(case["num_samples"])
        shards = case.get("shards")
        mine = [samples[i] for i in shards[rank]] if shards else dp.shard(samples)
        metrics = [trainer.train_step(mine) for _ in range(case.get("steps", 1))]
        out = Path(out_dir)
        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if trainer.masters is not None:
            tensors.update({f"master.{k}": v.contiguous() for k, v in trainer.masters.named_masters()})
        save_file(tensors, str(out / f"rank{rank}.safetensors"))
        (out / f"rank{rank}.json").write_text(json.dumps(metrics))
        # Every rank done with the group before one tears it down: gloo can abort a peer whose pair is closed
        # under it (a SIGABRT seen once under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()
