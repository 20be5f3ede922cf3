"""`CausalLM`: the one model definition shared by the rollout engine and the torch trainer.

Parameter names follow Hugging Face's (`model.layers.N.self_attn.o_proj.weight`, ...), except that matrices
applied to the same input are stacked: `self_attn.qkv_proj` (q, k, v rows), `mlp.gate_up_proj` (gate, up
rows) and the MoE experts (see moe.py); `miles.models.checkpoint` maps to and from the on-disk names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from miles.models import fused
from miles.models.args import ModelArgs
from miles.models.attention import AttentionContext, VarlenAttention
from miles.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from miles.models.moe import RoutingTrace, SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, moe_index: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = moe_index is not None
        self.mlp: nn.Module = (
            SparseMoeBlock(args, moe_index)
            if moe_index is not None
            else MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        )

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionContext,
        routing: RoutingTrace | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on x + `pending` (the previous layer's MLP output, not yet added); returns the residual
        stream and this layer's MLP output, which the next layer (or the final norm) adds in the same kernel
        as its norm. A MoE layer's output may be its [N, top_k, H] per-slot outputs, summed there too."""
        x, h = add_pending_norm(x, pending, self.input_layernorm)
        norm = self.post_attention_layernorm
        delta = self.self_attn(h, rope, attn)
        x, h = fused.call(fused.add_rms_norm, x, delta, norm.weight, norm.eps)
        if self.is_moe:
            return x, self.mlp.delta(h, routing)
        return x, self.mlp(h)


def add_pending_norm(
    x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + pending, its norm) in one fused call; `pending` is [N, H], a MoE layer's [N, top_k, H] slots
    (summed in float32 and rounded once, as a separate sum would), or None (the first layer)."""
    if pending is None:
        return x, fused.call(fused.rms_norm, x, norm.weight, norm.eps)
    if pending.dim() == 3:
        return fused.call(fused.add_slot_sum_rms_norm, x, pending, norm.weight, norm.eps)
    return fused.call(fused.add_rms_norm, x, pending, norm.weight, norm.eps)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        moe_ids = args.moe_layer_ids
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, moe_ids.index(i) if i in moe_ids else None)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)


@dataclass
class ForwardOutput:
    hidden: torch.Tensor
    """[N, hidden] final-norm hidden states of the packed tokens."""
    routing: torch.Tensor | None = None
    """[num_moe_layers, N, top_k] expert ids when routing was recorded."""


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        routing: RoutingTrace | None = None,
    ) -> ForwardOutput:
        """The core forward: N tokens of any number of sequences, flattened ([N] ids, [N] positions)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, rope, attn, routing)
        _, hidden = add_pending_norm(x, pending, self.model.norm)
        recorded = routing.stacked() if routing is not None and routing.record and routing.recorded else None
        return ForwardOutput(hidden=hidden, routing=recorded)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (no padding) -> logits [B, T, V]."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        cu_seqlens = [i * length for i in range(batch + 1)]
        out = self.forward_packed(input_ids.reshape(-1), positions, VarlenAttention(cu_seqlens))
        return self.compute_logits(out.hidden).view(batch, length, -1)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random initialisation (normal(0, std) for matrices, ones for norms), as HF's `_init_weights`."""
        for name, param in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, std, generator=generator)
