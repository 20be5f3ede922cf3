"""Model FLOPs and device peak FLOP/s for `train/mfu`.

FLOPs follow the usual accounting: 2 per multiply-add of every weight a token touches (attention
projections, the dense MLP or its top-k experts plus the router), the causal attention score and value
products, and the LM head only at the response rows where the trainer computes logits. A backward pass
costs twice a forward.
"""

from __future__ import annotations

import torch

from miles.models import ModelArgs

# Dense peak FLOP/s (bf16 tensor core, tf32 tensor core, plain fp32) from the vendors' data sheets.
_PEAKS: dict[str, tuple[float, float, float]] = {
    "B200": (2250e12, 1100e12, 80e12),
    "H200": (989.4e12, 494.7e12, 66.9e12),
    "H100": (989.4e12, 494.7e12, 66.9e12),
    "H800": (989.4e12, 494.7e12, 66.9e12),
    "A100": (312e12, 156e12, 19.5e12),
}


def body_params_per_token(args: ModelArgs) -> int:
    """Weights one token multiplies through in the decoder layers (only the chosen experts count)."""
    h, d = args.hidden_size, args.head_dim
    attention = h * d * (2 * args.num_attention_heads + 2 * args.num_key_value_heads)
    dense_mlp = 3 * h * args.intermediate_size
    moe_mlp = 3 * h * args.moe_intermediate_size * args.num_experts_per_tok + h * args.num_experts
    return sum(
        attention + (moe_mlp if args.is_moe_layer(i) else dense_mlp) for i in range(args.num_hidden_layers)
    )


def forward_flops(args: ModelArgs, fed_lengths: list[int], logit_rows: int) -> float:
    """FLOPs of one forward over packed sequences of `fed_lengths` tokens with logits at `logit_rows` rows."""
    tokens = sum(fed_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in fed_lengths)
    attention = 4 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * causal_pairs
    return (
        2.0 * body_params_per_token(args) * tokens
        + attention
        + 2.0 * args.hidden_size * args.vocab_size * logit_rows
    )


def device_peak_flops(device: torch.device, precision: str, override: float = 0.0) -> float | None:
    """Peak FLOP/s of `device` for `precision`; `override` > 0 wins; None when unknown (e.g. CPU)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, tf32, fp32) in _PEAKS.items():
        if key in name:
            if precision == "bf16":
                return bf16
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None
