"""`ModelArgs`: the architecture hyper-parameters, read from and written to a Hugging Face `config.json`.

Field names are Hugging Face's (`Qwen3Config`, `Qwen3MoeConfig`, `LlamaConfig`), so a config.json round-trips.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
}


_HF_DEFAULT_ROPE_THETA = 10_000.0
"""transformers' `rope_theta` when a config.json gives none (every config class here)."""
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    ),
}
"""The architecture defaults of transformers' `LlamaConfig`, `Qwen3Config` and `Qwen3MoeConfig`: what a field
left out of config.json means to transformers, where this dataclass's own defaults (Qwen3-0.6B-like, for
code that builds `ModelArgs` directly) differ. Token ids are not filled in (they are generation settings,
which the tokenizer and generation_config.json give)."""
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None for plain RoPE) as transformers 5 resolves them: the 4.x
    `rope_scaling` if set, else `rope_parameters`; `rope_theta` from that dict first, then the top-level field,
    then 10000; a top-level `original_max_position_embeddings` overrides the dict's for the scaled types."""
    parameters = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = parameters.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta")
    if theta is None:
        theta = _HF_DEFAULT_ROPE_THETA
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type in _ORIGINAL_CONTEXT_TYPES and config.get("original_max_position_embeddings") is not None:
        parameters["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return theta, parameters


@dataclass
class ModelArgs:
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = None
    """None derives hidden_size // num_attention_heads (Llama's default)."""
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    """None or Llama-3 style {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", ...}."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Mixture of experts (qwen3_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; miles runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.mlp_bias and self.model_type != "llama":
            raise ValueError(
                f"mlp_bias=True is a Llama option: {self.model_type} MLPs have no bias in transformers, which "
                "would drop the biases of a checkpoint written with them"
            )
        if self.model_type != "qwen3_moe":
            self.num_experts = 0

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Hugging Face's rule for which Qwen3-MoE layers are sparse."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold: max_position_embeddings, or with YaRN its factor times the original
        context when that is longer (Qwen3's long-context configs keep max_position_embeddings 40960 beside
        factor 4 over 32768: 131072; vLLM derives its max_model_len the same way)."""
        scaling = self.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings")
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("factor") and original:
            return max(self.max_position_embeddings, int(scaling["factor"] * original))
        return self.max_position_embeddings  # (without the original context, as vLLM: not extended)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Read a Hugging Face config.json as transformers reads it: a field it leaves out takes the default of
        its transformers config class (`_HF_DEFAULTS`, not this dataclass's), and RoPE settings follow
        transformers' precedence (see `_hf_rope`)."""
        config = dict(config)
        model_type = config.get("model_type")
        if model_type is None:
            raise ValueError(
                "config.json has no model_type; miles reads Hugging Face configs of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (transformers needs the field too)"
            )
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported (miles attends over the full context)")
        if "num_local_experts" in config and "num_experts" not in config:  # transformers 5's name
            config["num_experts"] = config.pop("num_local_experts")
        if model_type != "llama":
            config.pop("mlp_bias", None)  # Qwen3's MLPs have no bias; transformers ignores the field
        for key, value in _HF_DEFAULTS.get(model_type, {}).items():
            config.setdefault(key, value)
        if config.get("num_key_value_heads") is None and config.get("num_attention_heads") is not None:
            config["num_key_value_heads"] = config["num_attention_heads"]  # transformers: MHA
        config["rope_theta"], config["rope_scaling"] = _hf_rope(config)
        known = cls.__dataclass_fields__
        args = cls(**{k: v for k, v in config.items() if k in known and v is not None or k == "head_dim"})
        return args

    @classmethod
    def from_json(cls, path: str | Path) -> ModelArgs:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        config = asdict(self)
        config["architectures"] = [_ARCHITECTURES[self.model_type]]
        config["torch_dtype"] = "float32"
        if self.model_type != "qwen3_moe":
            for key in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
            ):
                config.pop(key)
        if self.model_type == "llama":
            config["pretraining_tp"] = 1
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            config["rope_parameters"] = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {k: v for k, v in config.items() if v is not None}

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = 3 * h * self.moe_intermediate_size * self.num_experts + self.num_experts * h
        total = sum(
            attn + (moe_mlp if self.is_moe_layer(i) else dense_mlp) for i in range(self.num_hidden_layers)
        )
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed
