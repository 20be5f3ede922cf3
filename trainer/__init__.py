"""Trainer: advantage estimators and policy losses (the algorithm registry) and the `torch` backend."""

from miles.trainer.algorithms import (
    compute_advantages,
    get_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from miles.trainer.losses import PolicyLossInput, PolicyLossOutput
from miles.trainer.torch_trainer import TorchTrainer

__all__ = [
    "PolicyLossInput",
    "PolicyLossOutput",
    "TorchTrainer",
    "compute_advantages",
    "get_advantage",
    "get_policy_loss",
    "register_advantage",
    "register_policy_loss",
]
