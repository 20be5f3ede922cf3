"""A draft head for speculative decoding (`rollout.speculative=head`): one small block over the model's own
hidden states, in the way of Hydra heads and DeepSeek's multi-token prediction, without attention.

The model's final-norm hidden state at position t (the row its logits for token t + 1 come from) and the
embedding of token t + 1 go in; out comes a hidden state in the same space, which the model's own LM head
turns into logits for token t + 2. Fed its own output and the token drawn from it, the head proposes
t + 3, t + 4, ... in turn. It shares the model's embedding and LM head (not its own weights: a head for
Qwen3-8B holds ~1/40 of the model), so a proposal of k tokens costs k passes over the head and the LM head,
no attention and no KV cache of its own: the context reaches the head only through the model's hidden state.

The one definition runs in the engine (proposing) and in the trainer (trainer/draft/head_trainer.py).
On disk: `draft_head_config.json` and `model.safetensors` (safetensors only).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from miles.models.args import ModelArgs
from miles.models.layers import MLP, RMSNorm

HEAD_CONFIG = "draft_head_config.json"
HEAD_WEIGHTS = "model.safetensors"


@dataclass
class DraftHeadArgs:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    """Of the model it drafts for (the head uses that model's embedding and LM head)."""
    rms_norm_eps: float = 1e-6

    @staticmethod
    def for_model(args: ModelArgs, intermediate_size: int = 0) -> DraftHeadArgs:
        """A head for `args`' model; `intermediate_size` 0: the model's dense MLP width (or, for a model of
        experts only, four times an expert's)."""
        width = intermediate_size or args.intermediate_size or 4 * args.moe_intermediate_size
        return DraftHeadArgs(args.hidden_size, width, args.vocab_size, args.rms_norm_eps)

    def check_fits(self, args: ModelArgs) -> None:
        if self.hidden_size != args.hidden_size or self.vocab_size != args.vocab_size:
            raise ValueError(
                f"the draft head was built for hidden size {self.hidden_size} and a {self.vocab_size}-token "
                f"vocabulary, the model has {args.hidden_size} and {args.vocab_size}: a head drafts only for "
                "the model (family and size) it was trained on; leave rollout.spec_head unset for a new one"
            )


class DraftHead(nn.Module):
    def __init__(self, args: DraftHeadArgs) -> None:
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.feature_norm = RMSNorm(h, args.rms_norm_eps)
        self.token_norm = RMSNorm(h, args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.mlp_norm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(h, args.intermediate_size)
        self.norm = RMSNorm(h, args.rms_norm_eps)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """features [N, h] (the model's final-norm hidden states at t, or this head's output for t) and the
        embeddings [N, h] of the tokens at t + 1 -> the head's hidden states for t + 1, [N, h]: the model's
        LM head over them gives logits for t + 2."""
        x = self.fc(torch.cat((self.feature_norm(features), self.token_norm(token_embeds)), dim=-1))
        x = x + self.mlp(self.mlp_norm(x))
        return self.norm(x)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Norms at one; the projections uniform in ±1/sqrt(fan_in) (torch's Linear default, seeded); the
        MLP's output projection at zero, so a new head starts as a mix of its two inputs."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name == "mlp.down_proj.weight":
                    param.zero_()
                else:
                    bound = param.shape[1] ** -0.5
                    param.copy_(torch.rand(param.shape, generator=generator) * 2 * bound - bound)


def new_draft_head(
    args: ModelArgs, intermediate_size: int, dtype: torch.dtype, device: torch.device, seed: int
) -> DraftHead:
    head = DraftHead(DraftHeadArgs.for_model(args, intermediate_size))
    head.init_weights(torch.Generator().manual_seed(seed))
    return head.to(device=device, dtype=dtype)


def save_draft_head(head: DraftHead, path: str | Path) -> Path:
    """Write the head's config and weights, assembled next to `path` and renamed into place (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
        save_file(tensors, str(tmp / HEAD_WEIGHTS), metadata={"format": "pt"})
        (tmp / HEAD_CONFIG).write_text(json.dumps(asdict(head.args), indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def is_draft_head(path: str | Path) -> bool:
    return (Path(path) / HEAD_CONFIG).is_file()


def load_draft_head(path: str | Path, dtype: torch.dtype, device: torch.device) -> DraftHead:
    path = Path(path)
    if not is_draft_head(path):
        raise FileNotFoundError(
            f"{path} is not a draft head folder (no {HEAD_CONFIG}); a head is written by `miles train` with "
            "rollout.speculative=head rollout.spec_draft_train=true, under checkpoints/step_N/draft_head"
        )
    args = DraftHeadArgs(**json.loads((path / HEAD_CONFIG).read_text()))
    head = DraftHead(args)
    state = load_file(str(path / HEAD_WEIGHTS))
    try:
        head.load_state_dict(state)
    except RuntimeError as err:  # missing, unexpected or misshapen tensors
        raise ValueError(f"{path} does not hold a draft head's weights: {err}") from None
    return head.to(device=device, dtype=dtype)
