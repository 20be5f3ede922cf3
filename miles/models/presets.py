"""Named model shapes for `miles init-model` and benchmarks, and random initialisation straight on a device.

`tiny` is sized for the CPU recipe (see `TINY`); the `qwen3-*` presets carry the exact shapes of the
published Hugging Face configs (and `smollm2-135m` the Llama shape of SmolLM2-135M), so GPU benchmarks
measure the real thing without downloading it.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.errors import MilesUserError
from miles.models.args import SUPPORTED_MODEL_TYPES, ModelArgs
from miles.models.checkpoint import resolve_dtype
from miles.models.model import CausalLM

# The tiny models: hidden 64, 2 layers, 4 query heads of 16, 2 KV heads, untied embeddings.
# Why this size: on 2 CPU cores a step costs per-layer op overhead plus FLOPs ~ params, so in a budget of
# minutes a shallow model makes more optimizer steps; with one token per character every digit is its own
# token and adding numbers is local pattern matching that 2 layers x 4 heads learn (one layer gathers the
# operands, the next combines them). Measured (SFT on the synthetic easy set, batch 32, lr 3e-3, 1 thread,
# exact greedy solutions on 128 held-out problems): this Qwen3-MoE shape reached 61% after 185 CPU-s;
# experts of width 64 reached 47% by then, 4 layers 13% after 213 CPU-s. rope_theta 1e4 (not Qwen's 1e6):
# with head_dim 16 there are only 8 rotary frequencies and prompts stay under ~1k tokens, so a large base
# would spend most of them on wavelengths longer than any sequence.
_TINY_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
)
TINY: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", intermediate_size=256, **_TINY_COMMON),
    # Top-2 of 4 experts of width 128: the same active MLP FLOPs per token as the dense tiny model.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        **_TINY_COMMON,
    ),
    "llama": dict(model_type="llama", intermediate_size=256, **_TINY_COMMON),
}

_QWEN3_COMMON: dict[str, Any] = dict(
    vocab_size=151936,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    attention_bias=False,
    bos_token_id=151643,  # <|endoftext|>
    eos_token_id=151645,  # <|im_end|>
)
# Values from the published config.json of each model on the Hugging Face hub.
REAL: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        **_QWEN3_COMMON,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        **_QWEN3_COMMON,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
}
PRESETS: tuple[str, ...] = ("tiny", *REAL)
_QWEN3_GENERATION: dict[str, Any] = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
}
REAL_GENERATION: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_GENERATION,
    "qwen3-1.7b": _QWEN3_GENERATION,
    "qwen3-4b": _QWEN3_GENERATION,
    "qwen3-8b": _QWEN3_GENERATION,
    "qwen3-30b-a3b": _QWEN3_GENERATION,
    "smollm2-135m": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
}
"""generation_config.json of the real models (stop ids), written when no tokenizer is given."""


def preset_args(arch: str | None, preset: str, vocab_size: int | None = None) -> ModelArgs:
    """`ModelArgs` of a preset. `arch` may be None for the real-shape presets (they fix it).

    `vocab_size` overrides the preset's (the tiny presets have no vocabulary of their own and default to the
    character tokenizer's size), so a model can be paired with the tokenizer it will run with.
    """
    if preset not in PRESETS:
        raise MilesUserError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if arch is not None and arch not in SUPPORTED_MODEL_TYPES:
        raise MilesUserError(f"unknown arch {arch!r}; choose one of: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if preset == "tiny":
        if arch is None:
            raise MilesUserError(f"preset tiny needs an arch: one of {', '.join(SUPPORTED_MODEL_TYPES)}")
        fields = dict(TINY[arch])
        if vocab_size is None:
            from miles.models.tokenizer import char_vocab_size

            vocab_size = char_vocab_size()
    else:
        fields = dict(REAL[preset])
        if arch is not None and arch != fields["model_type"]:
            raise MilesUserError(
                f"preset {preset} is a {fields['model_type']} model, not {arch}; "
                f"pass --arch {fields['model_type']} or leave --arch out"
            )
    if vocab_size is not None:
        if vocab_size <= 0:
            raise MilesUserError(f"vocab_size must be positive, got {vocab_size}")
        fields["vocab_size"] = vocab_size
    return ModelArgs(**fields)


def checkpoint_bytes(args: ModelArgs, dtype: str | torch.dtype) -> int:
    """Bytes the safetensors of a model with these args take in `dtype` (norm weights included)."""
    torch_dtype = resolve_dtype(dtype) or torch.float32
    with torch.device("meta"):
        model = CausalLM(args)
    numel = sum(p.numel() for p in model.parameters())  # tied weights are counted once, as on disk
    return numel * torch.empty((), dtype=torch_dtype).element_size()


def build_random_model(
    args: ModelArgs,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> CausalLM:
    """A randomly initialised `CausalLM` allocated directly on `device` in `dtype` (no float32 CPU copy).

    Same seed, device and dtype give the same weights. The RoPE frequencies stay float32 whatever `dtype`
    is, as in transformers.
    """
    torch_dtype = resolve_dtype(dtype) or torch.float32
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(std=std, generator=generator)
    return model
