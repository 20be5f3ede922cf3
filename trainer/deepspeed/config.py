"""The DeepSpeed config of `trainer.backend=deepspeed`, built from the Hydra config (no separate JSON).

`trainer.deepspeed_extra` is the escape hatch: its keys are merged over the built config (nested dicts key by
key), so any DeepSpeed setting the schema does not name can still be set, e.g.
`+trainer.deepspeed_extra.zero_optimization.reduce_bucket_size=50000000`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from miles.config import TrainerConfig
from miles.errors import MilesUserError

ZERO_STAGES = (1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu")


def check_deepspeed_settings(cfg: TrainerConfig) -> None:
    """The DeepSpeed settings a run can start with; each bad one is refused saying what to set."""
    if cfg.zero_stage not in ZERO_STAGES:
        raise MilesUserError(f"trainer.zero_stage={cfg.zero_stage} is not a ZeRO stage; use 1, 2 or 3")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(cfg, key) not in OFFLOAD_DEVICES:
            raise MilesUserError(
                f"trainer.{key}={getattr(cfg, key)!r}; use one of {', '.join(OFFLOAD_DEVICES)}"
            )
    if cfg.offload_param != "none" and cfg.zero_stage != 3:
        raise MilesUserError(
            "trainer.offload_param=cpu needs trainer.zero_stage=3 (stages 1 and 2 keep whole weights on "
            "every rank); use trainer.offload_optimizer=cpu with stages 1-2"
        )
    if not cfg.master_weights:
        raise MilesUserError(
            "trainer.master_weights=false is not available with trainer.backend=deepspeed (its ZeRO optimizer "
            "always keeps float32 master weights); leave trainer.master_weights=true"
        )
    if cfg.distributed_optimizer:
        raise MilesUserError(
            "trainer.distributed_optimizer is the torch/megatron backends' sharded AdamW; with "
            "trainer.backend=deepspeed ZeRO shards the optimizer already: leave it false"
        )
    if cfg.routing_replay:
        raise MilesUserError(
            "trainer.routing_replay is not available with trainer.backend=deepspeed; use trainer.backend=torch"
        )


def deepspeed_config(cfg: TrainerConfig, bf16_weights: bool, world_size: int) -> dict[str, Any]:
    """DeepSpeed's config dict for one engine over `world_size` data-parallel ranks.

    The trainer owns the micro-batches (packed by tokens, a varying number per step), so DeepSpeed's own
    accumulation is off (`managed_gradient_accumulation=false`: each `step()` ends one optimizer step) and
    its batch-size keys are nominal. Clipping is DeepSpeed's (over the whole model, across the shards)."""
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_scatter": True,
    }
    pin = torch.cuda.is_available()  # pinned host memory needs CUDA
    if cfg.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if cfg.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(cfg.optim.grad_clip),
        "zero_optimization": zero,
        # A non-finite gradient norm skips the step, as the torch backend does.
        "bf16": {"enabled": bf16_weights, "check_grad_overflow": True},
        # The client optimizer is the torch backend's AdamW (trainer/optim.py), offloaded or not.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16_weights:  # gradients summed in float32 across micro-batches, as MasterWeights does
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return merge(config, dict(cfg.deepspeed_extra))


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`: nested dicts merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
