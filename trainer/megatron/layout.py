"""Parameter names and layouts between `CausalLM` (the engine's model) and a megatron-core `GPTModel`.

Plain tensor arithmetic, no megatron import. Megatron's differences from our model's own names:
  * `linear_qkv` interleaves q, k and v per query group ([q heads of group g; k_g; v_g] for each g), where
    `qkv_proj` stacks all q rows, then all k rows, then all v rows;
  * norms and projections are named after their place (`pre_mlp_layernorm`, `linear_proj`, ...).
Dense `linear_fc1` is [gate; up] like our `gate_up_proj`, so it maps unchanged, and so do the stacked
experts of `GroupedExperts` (trainer/megatron/experts.py), whose layout is ours.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from miles.models import ModelArgs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Inside a layer: ours -> megatron's, for the tensors that map one to one.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate_up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.weight1",
    "mlp.experts.down_proj": "mlp.experts.weight2",
}
_LAYER_NAMES_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_TOP_NAMES_BACK = {v: k for k, v in _TOP_NAMES.items()}


def _qkv_groups(args: ModelArgs) -> tuple[int, int, int]:
    """(query groups, q heads per group, head dim)."""
    groups = args.num_key_value_heads
    return groups, args.num_attention_heads // groups, int(args.head_dim)  # type: ignore[arg-type]


def qkv_to_megatron(qkv: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """[q rows; k rows; v rows] -> per query group [q_g; k_g; v_g] (rows; columns untouched)."""
    groups, per_group, dim = _qkv_groups(args)
    q_rows = groups * per_group * dim
    kv_rows = groups * dim
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=0)
    rest = qkv.shape[1:]
    stacked = torch.cat(
        [
            q.reshape(groups, per_group * dim, *rest),
            k.reshape(groups, dim, *rest),
            v.reshape(groups, dim, *rest),
        ],
        dim=1,
    )
    return stacked.reshape(qkv.shape)


def qkv_from_megatron(qkv: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The inverse of `qkv_to_megatron`."""
    groups, per_group, dim = _qkv_groups(args)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * dim, *rest).split([per_group * dim, dim, dim], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)], dim=0)


def to_megatron(
    named: Iterable[tuple[str, torch.Tensor]], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our model's parameters (its own names) -> megatron's names and layouts.

    A tied lm_head is skipped (megatron shares the embedding); anything unknown is an error, so a model
    change that this table misses fails loudly instead of training with a tensor left at its init.
    """
    for name, tensor in named:
        if name in _TOP_NAMES:
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            yield _TOP_NAMES[name], tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"no megatron name for parameter {name!r}")
        layer, inner = match.groups()
        prefix = f"decoder.layers.{layer}."
        if inner == "self_attn.qkv_proj.weight":
            yield prefix + "self_attention.linear_qkv.weight", qkv_to_megatron(tensor, args)
        elif inner in _LAYER_NAMES:
            yield prefix + _LAYER_NAMES[inner], tensor
        else:
            raise KeyError(f"no megatron name for parameter {name!r}")


def from_megatron(
    named: Iterable[tuple[str, torch.Tensor]], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron's parameters -> our model's names and layouts (a tied model gets no separate lm_head, ours
    shares the embedding too)."""
    for name, tensor in named:
        if name in _TOP_NAMES_BACK:
            yield _TOP_NAMES_BACK[name], tensor
            continue
        match = _MEGATRON_LAYER.match(name)
        if match is None:
            raise KeyError(f"no model name for megatron parameter {name!r}")
        layer, inner = match.groups()
        prefix = f"model.layers.{layer}."
        if inner == "self_attention.linear_qkv.weight":
            yield prefix + "self_attn.qkv_proj.weight", qkv_from_megatron(tensor, args)
        elif inner in _LAYER_NAMES_BACK:
            yield prefix + _LAYER_NAMES_BACK[inner], tensor
        else:
            raise KeyError(f"no model name for megatron parameter {name!r}")


# Tensor parallelism: how megatron's parallel layers split each weight over the ranks of a TP group.
_COLUMN = ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def tp_partition(name: str) -> tuple[int, bool] | None:
    """(the dimension megatron splits, whether it is a gated fc1) for a megatron parameter name; None where
    every rank holds the whole tensor (norms). Column-parallel weights split their output rows (q/k/v by
    query group, thanks to the per-group layout; a gated fc1 splits gate and up separately, so each rank holds
    [gate_r; up_r]); row-parallel ones their input columns; the embedding and output layer the vocabulary."""
    if name in _VOCAB:
        return 0, False
    match = _MEGATRON_LAYER.match(name)
    inner = match.group(2) if match is not None else ""
    if inner in _COLUMN:
        return 0, inner == "mlp.linear_fc1.weight"
    if inner in _ROW:
        return 1, False
    return None


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s part of a whole megatron tensor (a view where it can be)."""
    part = tp_partition(name)
    if part is None or size == 1:
        return full
    dim, gated = part
    if gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    if full.shape[dim] % size:
        raise ValueError(
            f"{name}: dimension {dim} of {tuple(full.shape)} does not split over {size} TP ranks"
        )
    return full.chunk(size, dim=dim)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from every TP rank's part, in rank order (the inverse of `tp_shard`)."""
    part = tp_partition(name)
    if part is None or len(shards) == 1:
        return shards[0]
    dim, gated = part
    if gated:
        gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)


_PARTIAL_GRADIENT = (
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "mlp.router.weight",
)


def tp_partial_gradient(name: str) -> bool:
    """Whether a whole (unsplit) parameter's gradient is only this TP rank's share: the q/k norms' weights are
    applied to every head, and each rank holds some of the heads; a router sees only this rank's slice of the
    tokens (the MoE layer runs sequence-split under TP, megatron/parallel.py)."""
    match = _MEGATRON_LAYER.match(name)
    return match is not None and match.group(2) in _PARTIAL_GRADIENT


# Expert parallelism: the stacked experts [E, ...] split by expert over the EP ranks, and each expert's
# intermediate dimension over the expert-TP ranks (fc1 [E, 2I, H] gate and up separately, fc2 [E, H, I]).
_EXPERT_SPLIT = {"mlp.experts.weight1": (1, True), "mlp.experts.weight2": (2, False)}


def is_expert(name: str) -> bool:
    """Whether megatron parameter `name` is a stacked expert weight (split by expert parallelism)."""
    match = _MEGATRON_LAYER.match(name)
    return match is not None and match.group(2) in _EXPERT_SPLIT


def expert_shard(
    name: str, full: torch.Tensor, ep_rank: int, ep: int, etp_rank: int, etp: int
) -> torch.Tensor:
    """The part of a whole stacked expert weight that expert-parallel rank `ep_rank` and expert-TP rank
    `etp_rank` hold: its experts, and of each its share of the intermediate dimension."""
    inner = _MEGATRON_LAYER.match(name).group(2)  # type: ignore[union-attr]
    dim, gated = _EXPERT_SPLIT[inner]
    if full.shape[0] % ep or full.shape[dim] % (2 * etp if gated else etp):
        raise ValueError(f"{name}: {tuple(full.shape)} does not split over EP={ep} x expert-TP={etp}")
    part = full.chunk(ep, dim=0)[ep_rank]
    if etp == 1:
        return part
    if gated:
        gate, up = part.chunk(2, dim=dim)
        return torch.cat([gate.chunk(etp, dim=dim)[etp_rank], up.chunk(etp, dim=dim)[etp_rank]], dim=dim)
    return part.chunk(etp, dim=dim)[etp_rank]


def expert_unshard(name: str, parts: dict[tuple[int, int], torch.Tensor], ep: int, etp: int) -> torch.Tensor:
    """The whole stacked expert weight from every (EP rank, expert-TP rank)'s part (the inverse of
    `expert_shard`)."""
    inner = _MEGATRON_LAYER.match(name).group(2)  # type: ignore[union-attr]
    dim, gated = _EXPERT_SPLIT[inner]
    rows = []
    for ep_rank in range(ep):
        shards = [parts[(ep_rank, t)] for t in range(etp)]
        if gated and etp > 1:
            gates, ups = zip(*(shard.chunk(2, dim=dim) for shard in shards))
            rows.append(torch.cat([*gates, *ups], dim=dim))
        else:
            rows.append(torch.cat(shards, dim=dim))
    return torch.cat(rows, dim=0)
