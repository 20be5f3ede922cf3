"""Workers for tests/trainer/test_tensor_parallel.py (a module of their own so spawned processes import them)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles.distributed import DataParallel
from miles.models import CausalLM
from miles.trainer.backends import build_policy
from miles.trainer.logprobs import packed_logprobs
from miles.trainer.packing import pack
from tests.support.dp import make_trainer, scored_samples
from tests.support.trainer import VOCAB, tiny_model


def tiny_dense(tied: bool, vocab: int = VOCAB) -> CausalLM:
    # 4 query heads over 2 KV heads, fc 64 wide: they divide by 2 (an odd vocabulary is padded)
    return tiny_model(seed=3, num_experts=0, tie_word_embeddings=tied, vocab_size=vocab)


def tp_worker(rank: int, world: int, tp: int, store: str, case: dict, out_dir: str) -> None:
    """One rank of a tensor-parallel megatron trainer: logprobs, `steps` updates on its share of the samples,
    a checkpoint round trip, then the whole weights it gathered and its metrics."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dp = DataParallel(rank=rank, world_size=world, local_rank=rank)
        model = tiny_dense(case["tied"], case["vocab"]).to(getattr(torch, case.get("dtype", "float32")))
        policy = build_policy("megatron", copy.deepcopy(model), tensor_parallel=tp)
        samples = scored_samples(case["num_samples"])
        out = Path(out_dir)

        batch = pack(samples, list(range(len(samples))), 10_000, torch.device("cpu"))[0]
        logprobs = packed_logprobs(policy, batch, with_entropy=True)
        trainer = make_trainer(policy, case, dp)
        mine = dp.shard(samples)  # the loop's split; the TP group trains on the union of its ranks' shares
        metrics = [trainer.train_step(mine) for _ in range(case["steps"])]
        # whole tensors, a collective of the TP group, kept by TP rank 0: every rank resumes from rank 0's
        # as from the checkpoint it writes
        state = dp.broadcast_object(trainer.state_dict())
        resumed = make_trainer(build_policy("megatron", copy.deepcopy(model), tensor_parallel=tp), case, dp)
        resumed.model.load_from(_engine_model(model, trainer.model))
        resumed.load_state_dict(copy.deepcopy(state))
        after = trainer.train_step(mine), resumed.train_step(mine)

        weights = dict(trainer.model.engine_weights())
        resumed_weights = dict(resumed.model.engine_weights())
        if rank == 0:
            save_file(
                {
                    "logprobs": logprobs.logprobs.detach().contiguous(),
                    "entropy": logprobs.entropy.detach().contiguous(),
                    **{f"w.{k}": v.contiguous() for k, v in weights.items()},
                    **{f"resumed.{k}": v.contiguous() for k, v in resumed_weights.items()},
                },
                str(out / "rank0.safetensors"),
            )
        shapes = {k: list(v.shape) for k, v in state["tensors"].items()}
        (out / f"rank{rank}.json").write_text(
            json.dumps({"metrics": metrics, "after": after, "state_shapes": shapes})
        )
        dist.barrier()  # every rank done with the group before one tears it down (gloo aborts on an early close)
    finally:
        dist.destroy_process_group()


def _engine_model(model: CausalLM, policy: torch.nn.Module) -> CausalLM:
    """A CausalLM holding the policy's current (gathered) weights."""
    from miles.trainer.backends import copy_policy_into

    current = copy.deepcopy(model)
    copy_policy_into(policy, current)
    return current


__all__ = ["VOCAB", "tiny_dense", "tp_worker"]
