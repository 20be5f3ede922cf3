"""What backward keeps: the tensors autograd saves during one training forward, per token and decoder layer.

    python -m miles.bench.saved_tensors --model qwen3-30b-a3b --layers 1 --vocab 4096 --backend megatron
    python -m miles.bench.saved_tensors --model qwen3-30b-a3b --layers 1 --vocab 4096 --backend torch

One forward of `--tokens` packed tokens (sequences of `--seq-len`) runs under
`torch.autograd.graph.saved_tensors_hooks`, in the weights' dtype (`--dtype`, bf16 by default as
`miles bench train --dtype bfloat16` builds it) under bf16 autocast. Every saved tensor is counted once per
storage (views of one storage count once) and never when it is a parameter's, and is attributed to the
decoder layer whose forward saved it and to the source line that saved it (the innermost frame in miles or
megatron). With `--recompute selective|full` a checkpointed part saves nothing in the forward; the inputs
each checkpoint keeps are counted instead (as `checkpoint input`).

The forward runs at `--tokens` and twice that; the difference, over the added tokens, is the per-token
figure (weight-sized tensors, such as a router weight cast to float32, cancel out). On CPU the core
attention keeps the softmax matrix of each sequence ([heads, seq, seq]); on CUDA flash attention keeps
only q, k, v, its output and a [heads, seq] float32 log-sum-exp, so `attention core` lines are CPU-only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models import CausalLM, VarlenAttention
from miles.models.presets import PRESETS, build_random_model, preset_args

_OWN_FRAMES = ("/miles/", "/trainer/", "/megatron/")
_SKIPPED_FRAMES = ("saved_tensors.py", "/recompute.py", "/torch/")


@dataclass
class SavedTensors:
    """Bytes saved for backward, by (layer, dtype, where), each storage counted once."""

    bytes: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    shapes: dict[tuple[str, str, str], set[tuple[int, ...]]] = field(default_factory=lambda: defaultdict(set))

    def total(self, layer: str | None = None) -> int:
        return sum(b for (lay, _, _), b in self.bytes.items() if layer is None or lay == layer)


class SavedTensorAudit:
    """Records what autograd saves while active; `layer` is set by forward hooks on the decoder layers."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []  # holds every counted storage alive so its address is not reused
        self.layer = "outside layers"
        self.result = SavedTensors()

    def record(self, tensor: torch.Tensor, where: str | None = None) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.params or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.kept.append(tensor)
        key = (self.layer, str(tensor.dtype).removeprefix("torch."), where or _origin())
        self.result.bytes[key] += storage.nbytes()
        self.result.shapes[key].add(tuple(tensor.shape))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.record(tensor)
        return tensor

    @contextlib.contextmanager
    def active(self, layers: list[nn.Module]) -> Iterator[SavedTensors]:
        handles = []
        for i, layer in enumerate(layers):
            handles.append(
                layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "layer", f"layer {i}"))
            )
            handles.append(layer.register_forward_hook(lambda *_: setattr(self, "layer", "outside layers")))
        import miles.trainer.recompute as recompute

        original = recompute.checkpoint

        def checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
            # a non-reentrant checkpoint keeps its inputs (through the recompute closure), saves nothing else
            for value in (*args, *kwargs.values()):
                self.record(value, "checkpoint input")
            return original(fn, *args, **kwargs)

        recompute.checkpoint = checkpoint
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self.result
        finally:
            recompute.checkpoint = original
            for handle in handles:
                handle.remove()


_REPOSITORY = Path(__file__).resolve().parents[2].as_posix() + "/"


def _short_path(name: str) -> str:
    """A repository path for this project's files (`trainer/megatron/experts.py`), `megatron/...` for
    megatron-core's."""
    if name.startswith(_REPOSITORY):
        return name[len(_REPOSITORY) :]
    if "/megatron/" in name:
        return "megatron/" + name.split("/megatron/", 1)[1]
    return "/".join(name.split("/")[-2:])


def _origin() -> str:
    """The innermost frame of miles or megatron that saved the tensor: `file:line function`."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if any(s in name for s in _SKIPPED_FRAMES) or not any(s in name for s in _OWN_FRAMES):
            continue
        if name.endswith("miles/models/attention.py"):  # the varlen core attention's CPU path
            return "attention core (CPU path)"
        return f"{_short_path(name)}:{frame.lineno} {frame.name}"
    return "unknown"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from miles.models.model import DecoderLayer

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    return layers


def audit_forward(model: nn.Module, tokens: int, seq_len: int, seed: int = 0) -> SavedTensors:
    """One grad-enabled forward of `tokens` random tokens packed in sequences of `seq_len`, with the LM
    head's chunked logprobs; what autograd saved."""
    from miles.trainer.logprobs import chunked_logprobs

    gen = torch.Generator().manual_seed(seed)
    vocab = model.args.vocab_size
    device = model.device
    ids = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    audit = SavedTensorAudit(model)
    with audit.active(decoder_layers(model)) as saved, torch.autocast(device.type, dtype=torch.bfloat16):
        out = model.forward_packed(ids, positions, VarlenAttention(cu))
        hidden = out.hidden.to(torch.bfloat16)
        chunked_logprobs(hidden[:-1], model.lm_head.weight, ids[1:])
    return saved


@dataclass
class PerToken:
    """Bytes a token adds per decoder layer (mean over the layers) and outside them, by (dtype, where)."""

    layer: dict[tuple[str, str], float]
    outside: dict[tuple[str, str], float]
    shapes: dict[tuple[str, str], list[tuple[int, ...]]]

    @property
    def layer_total(self) -> float:
        return sum(self.layer.values())


def per_token(small: SavedTensors, large: SavedTensors, added_tokens: int, num_layers: int) -> PerToken:
    layer: dict[tuple[str, str], float] = defaultdict(float)
    outside: dict[tuple[str, str], float] = defaultdict(float)
    shapes: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    for key in set(small.bytes) | set(large.bytes):
        lay, dtype, where = key
        delta = (large.bytes.get(key, 0) - small.bytes.get(key, 0)) / added_tokens
        if lay == "outside layers":
            outside[(dtype, where)] += delta
        else:
            layer[(dtype, where)] += delta / num_layers
        shapes[(dtype, where)] = sorted(large.shapes.get(key, set()))[:3]
    return PerToken(layer={k: v for k, v in layer.items() if v}, outside=dict(outside), shapes=shapes)


def build(args: argparse.Namespace) -> nn.Module:
    model_args = preset_args(args.arch, args.model, vocab_size=args.vocab or None)
    model_args = replace(model_args, num_hidden_layers=min(args.layers, model_args.num_hidden_layers))
    model: CausalLM = build_random_model(model_args, args.dtype, "cpu", seed=args.seed)
    policy: nn.Module = model
    if args.backend == "megatron":
        from miles.trainer.megatron.policy import MegatronPolicy

        policy = MegatronPolicy.from_model(model)
        del model
    if args.recompute != "none":
        from miles.trainer.recompute import apply_recompute

        apply_recompute(policy, args.recompute)
    return policy


def measure(policy: nn.Module, tokens: int, seq_len: int) -> PerToken:
    small = audit_forward(policy, tokens, seq_len)
    large = audit_forward(policy, 2 * tokens, seq_len)
    return per_token(small, large, tokens, len(decoder_layers(policy)))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.bench.saved_tensors", description=__doc__)
    p.add_argument("--model", default="qwen3-30b-a3b", help=f"a preset ({', '.join(PRESETS)})")
    p.add_argument("--arch", default=None, help="with --model tiny: qwen3 | qwen3_moe | llama")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (0: the preset's)")
    p.add_argument("--backend", default="megatron", help="torch | megatron")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype: float32 | bfloat16")
    p.add_argument("--recompute", default="none", help="none | selective | full")
    p.add_argument("--tokens", type=int, default=256, help="the smaller of the two forwards' token counts")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    result = measure(build(args), args.tokens, args.seq_len)
    print(
        f"{args.model} ({args.layers} layers, {args.backend}, {args.dtype}, recompute={args.recompute}): "
        f"{result.layer_total / 1e3:.1f} kB saved per token and layer, "
        f"{sum(result.outside.values()) / 1e3:.1f} kB per token outside the layers"
    )
    for (dtype, where), b in sorted(result.layer.items(), key=lambda kv: -kv[1]):
        print(f"  {b:10.0f} B  {dtype:9s} {where}  {result.shapes[(dtype, where)]}")
    if args.json_out:
        rows = [
            {"dtype": d, "where": w, "bytes_per_token_layer": b, "shapes": result.shapes[(d, w)]}
            for (d, w), b in result.layer.items()
        ]
        report = {"bytes_per_token_layer": result.layer_total, "by_tensor": rows, "args": vars(args)}
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
