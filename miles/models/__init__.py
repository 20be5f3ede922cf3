"""One model definition (Qwen3, Qwen3-MoE, Llama) for both the rollout engine and the trainer."""

from miles.models.args import ModelArgs
from miles.models.attention import AttentionContext, VarlenAttention
from miles.models.checkpoint import from_pretrained, save_pretrained
from miles.models.model import CausalLM, ForwardOutput
from miles.models.moe import RoutingTrace

__all__ = [
    "AttentionContext",
    "CausalLM",
    "ForwardOutput",
    "ModelArgs",
    "RoutingTrace",
    "VarlenAttention",
    "from_pretrained",
    "save_pretrained",
]
