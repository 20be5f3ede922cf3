"""Building blocks shared by Qwen3, Qwen3-MoE and Llama: RMSNorm, RoPE, attention, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from miles.models import fused, fused_norm_rope
from miles.models.args import ModelArgs
from miles.models.attention import AttentionContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.call(fused.rms_norm, x, self.weight, self.eps)


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention factor) of the model's RoPE, as transformers
    computes them; the attention factor (YaRN's) scales cos and sin, 1.0 for the other types."""
    dim = args.head_dim
    # Built on the CPU explicitly, so a model constructed under `torch.device("meta")` still gets real values.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, args.max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(args, exponents, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    # Left out, transformers takes max_position_embeddings as the original context (as for YaRN).
    old_context = scaling.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(args: ModelArgs, exponents: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that rotate many times within the original context keep their
    frequency, those that rotate less than once are interpolated by `factor`, a linear ramp in between; cos
    and sin are scaled by the attention factor. Keys and defaults as transformers reads them (Qwen3's
    long-context configs: factor 4, original_max_position_embeddings 32768)."""
    dim, base = args.head_dim, args.rope_theta
    original = scaling.get("original_max_position_embeddings") or args.max_position_embeddings
    factor = scaling.get("factor") or args.max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, weight) / mscale(factor, weight_all) if weight and weight_all else mscale(factor)
        )

    def correction_dim(
        rotations: float,
    ) -> float:  # the dimension that turns `rotations` times in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated by `factor`
    freqs = base**exponents
    inv_freq = 1.0 / (factor * freqs) * (1 - keep) + 1.0 / freqs * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round the frequencies (at long
        # positions a bf16 inv_freq shifts rotation angles by whole radians; transformers keeps float32).
        self.inv_freq, self.attention_factor = rope_frequencies(args)
        self.max_positions = args.max_position_embeddings
        self._cpu_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Follow the module's device moves (.to / .cuda / to_empty) but never its dtype casts.
        self.inv_freq = self.inv_freq.to(fn(torch.empty(0)).device)
        self._cpu_tables = {}
        return super()._apply(fn, recurse)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, head_dim] of the rotation at each position, computed."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        # YaRN: scaled in float32 before the cast, as transformers does (the q/k kernels take cos and sin as given).
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self._cpu_tables = {}
        if positions.device.type != "cpu":  # computed: CUDA-graph capture must not read positions back
            return self.angles(positions, dtype)
        # On CPU each of the ~10 small ops costs more than the arithmetic: look the rows up in a table of
        # every position, computed once by the same ops (so the values are the same bit for bit).
        table = self._cpu_tables.get(dtype)
        if table is None:
            with torch.inference_mode(False), torch.no_grad():  # usable by training forwards too
                table = self.angles(torch.arange(self.max_positions), dtype)
            self._cpu_tables[dtype] = table
        try:
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        except IndexError:  # past the model's context (a trainer's forward may go there)
            return self.angles(positions, dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        bias = args.attention_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v as one matrix: one GEMM instead of three, and the k/v ones are too narrow (1024 columns
        # on Qwen3-8B) to fill the GPU. Checkpoints keep Hugging Face's q/k/v_proj (miles.models.checkpoint).
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, args.hidden_size, bias=bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionContext
    ) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        written: torch.Tensor | None = None  # q/k, with k and v already in the KV cache
        if self.q_norm is not None:
            assert self.k_norm is not None and self.q_norm.eps == self.k_norm.eps
            norm_args = (self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps, cos, sin)
            kv_write = attn.kv_write(self.layer_idx)
            if kv_write is not None:
                written = fused_norm_rope.qk_norm_rope_into_cache(qk, v, *norm_args, kv_write)
            qk = written if written is not None else fused_norm_rope.qk_norm_rope(qk, *norm_args)
        else:
            qk = fused.call(fused.rope, qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if written is not None:
            out = attn.attend(self.layer_idx, q, None, None, self.scale)
        else:
            out = attn.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        # gate and up as one matrix (one GEMM), as the stacked experts do; on disk they stay gate/up_proj.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(fused.call(fused.silu_mul, gate, up))
