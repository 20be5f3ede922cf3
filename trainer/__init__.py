"""Trainer: advantage estimators and policy losses (the algorithm registry), group filter and overlong
punishment, and `PolicyTrainer`, which updates the policy of the `torch` or `megatron` backend."""

from miles.trainer.algorithms import (
    compute_advantages,
    get_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from miles.trainer.losses import PolicyLossInput, PolicyLossOutput
from miles.trainer.policy_trainer import PolicyTrainer

__all__ = [
    "PolicyLossInput",
    "PolicyLossOutput",
    "PolicyTrainer",
    "compute_advantages",
    "get_advantage",
    "get_policy_loss",
    "register_advantage",
    "register_policy_loss",
]
