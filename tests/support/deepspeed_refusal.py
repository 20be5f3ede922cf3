"""The worker of tests/miles/test_safe_unpickle.py's DeepSpeed case (a module of its own for spawn)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miles.config import AlgorithmConfig, OptimConfig, TrainerConfig
from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.trainer import PolicyTrainer
from miles.trainer.backends import build_policy
from tests.support.dp import scored_samples
from tests.support.malicious import TouchesMarker
from tests.support.tp import tiny_dense


def refusal_worker(rank: int, out_dir: str) -> None:
    """One process, bf16 ZeRO-3 with CPU offload: an update, a save, the weights perturbed and the state
    loaded back (equal again); then the optimizer shard replaced by a crafted pickle and loaded, through the
    backend and through DeepSpeed's checkpoint engine directly."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    cfg = TrainerConfig(
        backend="deepspeed",
        zero_stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        global_batch_size=6,
        micro_batch_tokens=24,
        optim=OptimConfig(grad_clip=1.0),
        lr=1e-2,
    )
    policy = build_policy("deepspeed", tiny_dense(tied=True).to(torch.bfloat16))
    trainer = PolicyTrainer(policy, cfg, AlgorithmConfig(), temperature=1.0, dp=DataParallel())
    trainer.train_step(scored_samples(6))
    trainer.zero.save(out / "zero")
    saved = {n: t.clone() for n, t in trainer.model.engine_weights()}
    trainer.train_step(scored_samples(6))
    trainer.zero.load(out / "zero")
    restored = all(torch.equal(t, saved[n]) for n, t in trainer.model.engine_weights())

    shard = next((out / "zero" / "state").glob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": TouchesMarker(out / "ran")}, shard)
    report: dict = {"restored": restored}
    try:
        trainer.zero.load(out / "zero")
    except MilesUserError as err:
        report["refused"] = str(err)
    try:
        trainer.zero.engine.checkpoint_engine.load(str(shard), map_location="cpu")
    except MilesUserError as err:
        report["engine_refused"] = str(err)
    (out / "report.json").write_text(json.dumps(report))
