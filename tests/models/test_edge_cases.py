"""config.json files that transformers reads one way and miles must read the same way (or refuse).

Each case is a hand-written config.json (a field left out, set twice, or set where the architecture ignores
it): transformers builds a model from it, every weight is randomised and saved, and the folder loads into
miles, whose float32 logits must equal transformers' (and survive miles' own save back into transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miles.models import ModelArgs, from_pretrained, save_pretrained
from tests.models.test_parity import TOLERANCE, random_ids, randomize_, relative_error

LLAMA: dict[str, Any] = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
)
QWEN3: dict[str, Any] = {
    **LLAMA,
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 32,
}
QWEN3_MOE: dict[str, Any] = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 2,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 16,
}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def without(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in keys}


def hf_folder(config: dict[str, Any], folder: Path) -> Path:
    """A checkpoint of random weights whose config.json is exactly `config` (as a user wrote it)."""
    hf_config = AutoConfig.for_model(**json.loads(json.dumps(config)))
    hf_config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize_(hf, seed=1)
    hf.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@torch.no_grad()
def assert_same_logits(folder: Path, length: int = 80) -> None:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = from_pretrained(folder).eval()
    ids = random_ids(hf.config.vocab_size, batch=1, length=length, seed=2)
    expected = hf(ids).logits
    assert relative_error(ours(ids), expected) <= TOLERANCE
    # Written back by miles (every field explicit), transformers reads the same model.
    again = AutoModelForCausalLM.from_pretrained(
        save_pretrained(ours, folder.parent / "ours"), dtype=torch.float32
    )
    assert relative_error(again.eval()(ids).logits, expected) <= TOLERANCE


MISSING_FIELDS = {
    # transformers' config classes fill a left-out field with their own default: rope_theta 1e4 (not 1e6),
    # Qwen3's head_dim 128 (not hidden / heads), Llama's num_key_value_heads = num_attention_heads,
    # Qwen3-MoE's norm_topk_prob false, Llama's max_position_embeddings 2048 (YaRN's original context).
    "llama_no_rope_theta": without(LLAMA, "rope_theta"),
    "qwen3_no_rope_theta": without(QWEN3, "rope_theta"),
    "qwen3_no_head_dim": without(QWEN3, "head_dim"),
    "llama_no_num_key_value_heads": without(LLAMA, "num_key_value_heads"),
    "qwen3_moe_no_norm_topk_prob": QWEN3_MOE,
    "llama_yarn_no_max_position_embeddings": {
        **without(LLAMA, "max_position_embeddings"),
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    },
}


@pytest.mark.parametrize("name", list(MISSING_FIELDS))
def test_left_out_fields_take_transformers_defaults(name: str, tmp_path: Path) -> None:
    assert_same_logits(hf_folder(MISSING_FIELDS[name], tmp_path / "hf"))


def test_left_out_moe_sizes_take_transformers_defaults() -> None:
    args = ModelArgs.from_hf_dict(
        without(QWEN3_MOE, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    )
    hf = AutoConfig.for_model(
        **without(QWEN3_MOE, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    )
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.norm_topk_prob) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
        hf.norm_topk_prob,
    )
    assert args.moe_layer_ids == [0, 1]


def test_rope_theta_in_rope_parameters_wins_over_the_top_level_one(tmp_path: Path) -> None:
    """transformers takes `rope_parameters.rope_theta` first (miles writes both forms; a user editing the
    transformers 5 one must get what transformers runs)."""
    config = {**LLAMA, "rope_theta": 100.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}
    assert_same_logits(hf_folder(config, tmp_path / "hf"))


@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_top_level_original_max_position_embeddings_wins(rope_type: str, tmp_path: Path) -> None:
    """A top-level original_max_position_embeddings overrides the one inside rope_scaling in transformers."""
    scaling = LLAMA3_SCALING if rope_type == "llama3" else {"rope_type": "yarn", "factor": 4.0}
    config = {
        **LLAMA,
        "original_max_position_embeddings": 8,
        "rope_scaling": {**scaling, "original_max_position_embeddings": 64},
    }
    assert_same_logits(hf_folder(config, tmp_path / "hf"))


def test_llama3_scaling_without_original_context_uses_max_position_embeddings(tmp_path: Path) -> None:
    config = {**LLAMA, "max_position_embeddings": 32, "rope_scaling": LLAMA3_SCALING}
    assert_same_logits(hf_folder(config, tmp_path / "hf"))


@pytest.mark.parametrize("base", [QWEN3, {**QWEN3_MOE, "norm_topk_prob": True}], ids=["qwen3", "qwen3_moe"])
def test_mlp_bias_is_ignored_by_qwen3_as_transformers_does(base: dict[str, Any], tmp_path: Path) -> None:
    assert_same_logits(hf_folder({**base, "mlp_bias": True}, tmp_path / "hf"))
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelArgs(model_type=base["model_type"], mlp_bias=True)


def test_config_without_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match="model_type"):
        ModelArgs.from_hf_dict(without(LLAMA, "model_type"))
