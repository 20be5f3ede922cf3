"""`trainer.backend`: which model definition the trainer updates.

`torch` trains the engine's own `CausalLM` (in the embedded placement both are the same module, so a weight
sync copies nothing). `megatron` trains a megatron-core copy of it (`MegatronPolicy`), whose weights the sync
converts into the engine's model after every step. `deepspeed` trains a copy of it under a DeepSpeed ZeRO
engine (`DeepSpeedPolicy`), whose gathered weights the sync copies into the engine's model.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.errors import MilesUserError
from miles.models import CausalLM

BACKENDS = ("torch", "megatron", "deepspeed")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise MilesUserError(f"unknown trainer.backend={backend!r}; use one of {', '.join(BACKENDS)}")


def check_tensor_parallel(backend: str, tensor_parallel: int) -> None:
    if tensor_parallel < 1 or (tensor_parallel > 1 and backend != "megatron"):
        raise MilesUserError(
            f"trainer.tensor_parallel_size={tensor_parallel} needs trainer.backend=megatron (and a size >= 1)"
        )


def build_policy(
    backend: str,
    model: CausalLM,
    routing_replay: bool = False,
    precision: str = "fp32",
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> nn.Module:
    """The module the trainer updates, starting from `model`'s weights."""
    check_backend(backend)
    check_tensor_parallel(backend, tensor_parallel)
    if (expert_parallel != 1 or expert_tensor_parallel not in (None, 1)) and backend != "megatron":
        raise MilesUserError(
            "trainer.expert_parallel_size and trainer.expert_tensor_parallel_size need trainer.backend=megatron"
        )
    if backend == "torch":
        return model
    if backend == "deepspeed":
        if routing_replay:
            raise MilesUserError(
                "trainer.routing_replay is not available with trainer.backend=deepspeed; use trainer.backend=torch"
            )
        from miles.trainer.deepspeed.policy import DeepSpeedPolicy

        return DeepSpeedPolicy(model)
    if precision == "bf16" and model.device.type != "cuda":
        raise MilesUserError(
            "trainer.precision=bf16 with trainer.backend=megatron needs CUDA (megatron-core's linear layers "
            "carry autocast into their backward on CUDA only); use trainer.precision=fp32 on CPU"
        )
    from miles.trainer.megatron.policy import MegatronPolicy

    return MegatronPolicy.from_model(model, tensor_parallel, expert_parallel, expert_tensor_parallel)


def copy_policy_into(policy: nn.Module, model: CausalLM) -> None:
    """Make `model` hold the trainer's current weights (nothing to do when the trainer trains `model`)."""
    if policy is model:
        return
    from miles.models.checkpoint import load_state_into

    with torch.no_grad():
        load_state_into(model, policy.iter_engine_weights())  # type: ignore[operator]
