"""Draft tokens from a draft head over the model's hidden states (`rollout.speculative=head`).

The head (miles/models/draft_head.py) starts from the model's final-norm hidden state at the row whose logits
the request's last token was sampled from (the engine keeps the last step's: `ModelRunner.last_hidden`)
and that token's embedding; each of its k steps gives logits through the model's LM head, a draft token
drawn from them as draft_draws.py says, and the state the next step starts from. A request that was not in
the last step has no hidden state to start from and gets no draft this step. Nothing is cached between
proposals, so nothing has to be dropped when requests leave, retract, or the head's weights change.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from miles.config import RolloutConfig
from miles.models import fused
from miles.models.draft_head import DraftHead, load_draft_head, new_draft_head
from miles.models.model import CausalLM
from miles.rollout.draft_draws import DraftDraws
from miles.rollout.forward_batch import host_to_device
from miles.rollout.request import Request

log = logging.getLogger(__name__)


def load_head(model: CausalLM, cfg: RolloutConfig, head: DraftHead | None = None) -> DraftHead:
    """The draft head of `rollout.speculative=head`: `head` if given, else `rollout.spec_head` loaded in the
    model's dtype on its device, else a new one (which proposes next to nothing until it is trained)."""
    if head is None:
        if cfg.spec_head:
            head = load_draft_head(Path(cfg.spec_head).expanduser(), model.dtype, model.device)
        else:
            if not cfg.spec_draft_train:
                log.warning(
                    "rollout.speculative=head with a new, untrained draft head: its drafts are mostly rejected. "
                    "Set rollout.spec_head to a trained head, or train it with rollout.spec_draft_train=true"
                )
            head = new_draft_head(
                model.args, cfg.spec_head_intermediate_size, model.dtype, model.device, cfg.seed + 1
            )
    head.args.check_fits(model.args)
    if head.device != model.device or head.dtype != model.dtype:
        raise ValueError(
            f"the draft head is {head.dtype} on {head.device}, the model {model.dtype} on {model.device}: "
            "load it with the model's dtype and device"
        )
    return head.eval()


class DraftHeadProposer:
    def __init__(self, head: DraftHead, model: CausalLM, fused_kernels: bool) -> None:
        self.head, self.model, self.fused_kernels = head, model, fused_kernels
        self.draws = 0

    def propose(
        self, reqs: list[Request], ks: list[int], hidden: torch.Tensor, rows: list[int]
    ) -> list[list[int]]:
        """ks[i] draft tokens to follow each request's sequence, from row rows[i] of `hidden` (the model's
        hidden state at the request's next-to-last position)."""
        if not reqs:
            return []
        device = self.head.device
        state = hidden[host_to_device(np.asarray(rows, dtype=np.int64), device)]
        last = [req.output_ids[-1] for req in reqs]
        tokens = host_to_device(np.asarray(last, dtype=np.int64), device)
        draws = DraftDraws(reqs, self.model.args.vocab_size, device, self.fused_kernels)
        columns = []
        embed, lm_head = self.model.model.embed_tokens, self.model.lm_head
        # Every request takes max(ks) steps (ks differ only near a request's end); one read at the end.
        with fused.fused_kernels(self.fused_kernels):
            for step in range(max(ks)):
                state = self.head(state, embed(tokens))
                tokens = draws.sample(lm_head(state), None, step)
                columns.append(tokens)
        self.draws += draws.made
        drawn = torch.stack(columns, dim=1).tolist()
        return [row[:k] for row, k in zip(drawn, ks)]
