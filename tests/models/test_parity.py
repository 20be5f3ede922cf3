"""Our Qwen3 / Qwen3-MoE / Llama against transformers' own implementations, float32.

Each case builds a transformers model from a native config, gives every parameter a random value,
saves it with transformers, loads it into ours (and ours back into transformers) and compares logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from miles.models import RoutingTrace, VarlenAttention, from_pretrained, save_pretrained

TOLERANCE = 1e-5

CASES = {
    # head_dim 20 (not a power of two, not hidden/heads), 6 query heads over 2 KV heads, untied.
    "qwen3_hd20_gqa3_untied": (
        Qwen3ForCausalLM,
        Qwen3Config(
            vocab_size=97,
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=20,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
        ),
    ),
    # head_dim 12, 3 query heads over 1 KV head (MQA), tied embeddings.
    "qwen3_hd12_mqa_tied": (
        Qwen3ForCausalLM,
        Qwen3Config(
            vocab_size=64,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=12,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            rms_norm_eps=1e-5,
        ),
    ),
    # Sparse every 2nd layer (1, 5), layer 3 forced dense by mlp_only_layers; 6 experts top-3, raw top-k weights.
    "qwen3_moe_step2_mlponly_unnormed": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            vocab_size=80,
            hidden_size=36,
            intermediate_size=56,
            moe_intermediate_size=20,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=6,
            num_experts_per_tok=3,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    # Every layer sparse except layer 0; 4 experts top-2, normalised top-k weights, tied.
    "qwen3_moe_normed_tied": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            vocab_size=72,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
    ),
    # Llama 3 RoPE scaling (original context 16 < the test's 40 tokens), biases on, head_dim 12 != 48/6.
    "llama_rope_llama3_bias": (
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=70,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # YaRN as Qwen3's long-context configs set it (factor 4), over an original context of 16 < the 40 tokens.
    "qwen3_rope_yarn": (
        Qwen3ForCausalLM,
        Qwen3Config(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # YaRN with every option set: an explicit attention factor, other ramp ends, no truncation (MoE, untied).
    "qwen3_moe_rope_yarn_options": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            vocab_size=60,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 24,
                "attention_factor": 1.3,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
        ),
    ),
    # Plain Llama: derived head_dim 10, full multi-head attention, tied, linear RoPE scaling.
    "llama_mha_tied_linear": (
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=50,
            hidden_size=40,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
        ),
    ),
}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest elementwise difference relative to the largest reference magnitude."""
    return float((ours.double() - reference.double()).abs().max() / reference.double().abs().max())


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights too, so a skipped norm shows); matrices with std 1/sqrt(fan_in)
    so activations stay O(1) and MoE routing is decisive rather than a near-tie."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif param.dim() == 1:
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))


def random_ids(vocab_size: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(name, transformers model, its checkpoint folder, our model loaded from that folder), built once."""
    if name not in _BUILT:
        cls, config = CASES[name]
        torch.manual_seed(0)
        hf = cls(config).eval()
        randomize_(hf, seed=1)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        _BUILT[name] = (name, hf, folder, from_pretrained(folder, dtype="float32").eval())
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[name for name in CASES if name.startswith("qwen3_moe")])
def moe_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _build(request.param, tmp_path_factory)


@torch.no_grad()
def test_logits_match_transformers(case) -> None:
    name, hf, _, ours = case
    ids = random_ids(hf.config.vocab_size, batch=2, length=40, seed=2)
    expected = hf(ids).logits
    assert relative_error(ours(ids), expected) <= TOLERANCE, name


@torch.no_grad()
def test_our_checkpoint_loads_in_transformers(case, tmp_path: Path) -> None:
    name, hf, _, ours = case
    save_pretrained(ours, tmp_path / "ours")
    hf_again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(hf_again) is type(hf)
    ours_again = from_pretrained(tmp_path / "ours")
    ids = random_ids(hf.config.vocab_size, batch=1, length=17, seed=3)
    # The same weights through the same code give bit-identical logits on both sides.
    assert torch.equal(hf_again(ids).logits, hf(ids).logits), name
    assert torch.equal(ours_again(ids), ours(ids)), name
    assert relative_error(ours_again(ids), hf_again(ids).logits) <= TOLERANCE


@torch.no_grad()
def test_packed_forward_equals_per_sequence(case) -> None:
    name, _, _, ours = case
    lengths = [5, 11, 1, 7]
    seqs = [random_ids(ours.args.vocab_size, 1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = [0]
    for n in lengths:
        cu_seqlens.append(cu_seqlens[-1] + n)
    separate = [ours(seq[None])[0] for seq in seqs]
    for block_mask_max_tokens in (VarlenAttention.block_mask_max_tokens, 0):  # one masked call; per sequence
        attn = VarlenAttention(cu_seqlens)
        attn.block_mask_max_tokens = block_mask_max_tokens
        logits = ours.compute_logits(ours.forward_packed(ids, positions, attn).hidden)
        for i, expected in enumerate(separate):
            got = logits[cu_seqlens[i] : cu_seqlens[i + 1]]
            assert relative_error(got, expected) <= TOLERANCE, (name, block_mask_max_tokens, i)


@torch.no_grad()
def test_recorded_routing_matches_transformers_router(moe_case) -> None:
    name, hf, _, ours = moe_case
    ids = random_ids(ours.args.vocab_size, 1, 23, seed=4)
    chosen_by_hf: list[torch.Tensor] = []
    routers = [m for m in hf.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert len(routers) == len(ours.args.moe_layer_ids)
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen_by_hf.append(out[2])) for r in routers]
    try:
        hf(ids)
    finally:
        for hook in hooks:
            hook.remove()
    trace = RoutingTrace(record=True)
    out = ours.forward_packed(ids[0], torch.arange(ids.shape[1]), VarlenAttention([0, ids.shape[1]]), trace)
    assert out.routing is not None
    assert out.routing.shape == (len(ours.args.moe_layer_ids), ids.shape[1], ours.args.num_experts_per_tok)
    for layer, hf_chosen in enumerate(chosen_by_hf):
        assert torch.equal(out.routing[layer].sort(-1).values, hf_chosen.sort(-1).values), (name, layer)


@torch.no_grad()
def test_routing_replay_reproduces_and_steers(moe_case) -> None:
    name, _, _, ours = moe_case
    n = 19
    ids = random_ids(ours.args.vocab_size, 1, n, seed=5)[0]
    positions = torch.arange(n)

    def run(trace: RoutingTrace):
        out = ours.forward_packed(ids, positions, VarlenAttention([0, n]), trace)
        return ours.compute_logits(out.hidden), out.routing

    recorded_logits, routing = run(RoutingTrace(record=True))
    replayed_logits, rerecorded = run(RoutingTrace(record=True, replay=routing))
    assert torch.equal(replayed_logits, recorded_logits)
    assert torch.equal(rerecorded, routing)
    as_list, _ = run(RoutingTrace(record=False, replay=list(routing.unbind(0))))
    assert torch.equal(as_list, recorded_logits)
    # Other experts (a per-token permutation, so still top_k distinct ones) must change the output.
    shifted = (routing + 1) % ours.args.num_experts
    steered_logits, steered = run(RoutingTrace(record=True, replay=shifted))
    assert torch.equal(steered, shifted)
    assert relative_error(steered_logits, recorded_logits) > 1e-3, name


@torch.no_grad()
def test_bfloat16_load_keeps_rope_frequencies_float32(case) -> None:
    _, hf, folder, _ = case
    ours = from_pretrained(folder, dtype="bfloat16")
    hf_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf_bf16.model.rotary_emb.inv_freq)
