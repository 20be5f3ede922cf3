"""Workers for tests/trainer/test_deepspeed.py (a module of their own so spawned processes import them)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.distributed import DataParallel
from miles.models import CausalLM
from miles.trainer import PolicyTrainer
from miles.trainer.backends import build_policy
from miles.weight_sync import InProcessWeightSync
from tests.support.dp import scored_samples, tiny_moe
from tests.support.tp import tiny_dense

SHARDS = [[0, 1, 2, 3, 4], [5]]
"""Uneven on purpose: rank 1 runs fewer micro-batches than rank 0 and pads with zero-weight passes."""


def trainer_for(policy: torch.nn.Module, case: dict, dp: DataParallel) -> PolicyTrainer:
    cfg = TrainerConfig(
        backend=case["backend"],
        zero_stage=case.get("stage", 2),
        offload_optimizer=case.get("offload", "none"),
        offload_param=case.get("offload", "none"),
        global_batch_size=case.get("global_batch_size", 6),
        micro_batch_tokens=24,
        optim=OptimConfig(grad_clip=1.0, weight_decay=0.01, eps=1e-6),
        lr=1e-2,
    )
    algorithm = AlgorithmConfig(loss_agg="token_mean", tis=True, entropy_coef=0.01)
    return PolicyTrainer(policy, cfg, algorithm, temperature=1.0, dp=dp)


def _model(case: dict) -> CausalLM:
    # the MoE one: 8 experts, top 2, so some experts get no gradient on a rank in a micro-batch
    return tiny_moe() if case.get("moe") else tiny_dense(case["tied"])


class LoadingEngine:
    """The engine side of a sync as the real engine loads weights (miles.rollout.weights.load_weights)."""

    def __init__(self, model: CausalLM) -> None:
        self.model, self.weight_version = model, 0

    def update_weights(self, buckets, version: int) -> None:
        from miles.rollout.weights import load_weights

        load_weights(self.model, buckets)
        self.weight_version = version


def zero_worker(rank: int, world: int, store: str, case: dict, out_dir: str) -> None:
    """One rank: the torch backend's 3 updates, DeepSpeed's on the same shares, a sync of the gathered weights
    into an engine model, and a resume after update 1 from DeepSpeed's sharded checkpoint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        model = _model(case)
        samples = scored_samples(6)
        mine = [samples[i] for i in SHARDS[rank]]
        out = Path(out_dir)

        torch_trainer = trainer_for(copy.deepcopy(model), {"backend": "torch"}, dp)
        want = [torch_trainer.train_step(mine) for _ in range(3)]

        ds_case = {"backend": "deepspeed", "stage": case["stage"]}
        trainer = trainer_for(build_policy("deepspeed", model), ds_case, dp)
        got = [trainer.train_step(mine)]
        trainer.zero.save(out / "zero")
        state = json.loads(json.dumps(trainer.state_dict()["meta"]))
        at_save = CausalLM(model.args)
        at_save.load_state_dict(dict(trainer.model.engine_weights()), strict=False)
        got += [trainer.train_step(mine) for _ in range(2)]

        engine = LoadingEngine(_model(case))
        sync = InProcessWeightSync(trainer.model, engine, bucket_bytes=2048).sync(version=3)
        gathered = dict(trainer.model.engine_weights())

        resumed = trainer_for(build_policy("deepspeed", _model(case)), ds_case, dp)
        resumed.model.load_from(at_save)
        resumed.zero.load(out / "zero")
        resumed.load_state_dict({"tensors": {}, "meta": state})
        again = [resumed.train_step(mine) for _ in range(2)]
        resumed_weights = dict(resumed.model.engine_weights())

        if rank == 0:
            tensors = {f"torch.{n}": p.detach() for n, p in torch_trainer.model.named_parameters()}
            tensors.update({f"zero.{n}": t for n, t in gathered.items()})
            tensors.update({f"engine.{n}": p.detach() for n, p in engine.model.named_parameters()})
            tensors.update({f"resumed.{n}": t for n, t in resumed_weights.items()})
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "weights.safetensors"))
            report = {
                "torch": want,
                "zero": got,
                "resumed": again,
                "checksum_ok": sync.checksum_ok,
                "mismatched": sync.mismatched,
                "sync_bytes": sync.bytes,
            }
            (out / "report.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def offload_worker(rank: int, out_dir: str) -> None:
    """One process (no group set up by hand: the backend makes its own): bf16 weights under ZeRO-3 with the
    optimizer and the weight shards offloaded to the host, against the torch backend's float32 masters."""
    torch.set_num_threads(1)
    model = tiny_dense(tied=True).to(torch.bfloat16)
    samples = scored_samples(6)
    torch_trainer = trainer_for(copy.deepcopy(model), {"backend": "torch"}, DataParallel())
    case = {"backend": "deepspeed", "stage": 3, "offload": "cpu"}
    trainer = trainer_for(build_policy("deepspeed", model), case, DataParallel())
    report = {"torch": [torch_trainer.train_step(samples) for _ in range(3)]}
    report["zero"] = [trainer.train_step(samples) for _ in range(3)]
    tensors = {f"torch.{n}": p.detach() for n, p in torch_trainer.model.named_parameters()}
    tensors.update({f"zero.{n}": t for n, t in trainer.model.engine_weights()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir) / "weights.safetensors"))
    (Path(out_dir) / "report.json").write_text(json.dumps(report))
