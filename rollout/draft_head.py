"""Draft tokens from a draft head over the model's hidden states (`rollout.speculative=head`).

The head (miles/models/draft_head.py) starts from the model's final-norm hidden state at the row whose logits
the request's last token was sampled from (the engine keeps the last step's: `ModelRunner.last_hidden`)
and that token's embedding; each of its k steps gives logits through the model's LM head, a draft token
drawn from them as draft_draws.py says, and the state the next step starts from. A request that was not in
the last step has no hidden state to start from and gets no draft this step. Nothing is cached between
proposals, so nothing has to be dropped when requests leave, retract, or the head's weights change. With CUDA
graphs on, a proposal whose rows all take the plain draw, or are all greedy, replays the k steps as one graph
(draft_head_graph.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.config import RolloutConfig
from miles.models import fused
from miles.models.draft_head import DraftHead, load_draft_head, new_draft_head
from miles.models.model import CausalLM
from miles.rollout.draft_draws import DraftDraws
from miles.rollout.draft_head_graph import HeadProposalGraphs
from miles.rollout.forward_batch import host_to_device
from miles.rollout.request import Request
from miles.rollout.sampler_graph import plain_draw

if TYPE_CHECKING:
    from miles.rollout.cuda_graph import CudaGraphRunner

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


def proposal_graphs(
    head: DraftHead, model: CausalLM, cfg: RolloutConfig, graphs: CudaGraphRunner | None
) -> HeadProposalGraphs | None:
    """The proposal graphs beside the engine's decode graphs `graphs` (None without them), for the batch
    sizes that speculate: those of the verify graphs (cuda_graph.py)."""
    if graphs is None:
        return None
    from miles.rollout.cuda_graph import VERIFY_MAX_BATCH

    largest = graphs.verify_max_batch or VERIFY_MAX_BATCH
    return HeadProposalGraphs(head, model, cfg.spec_draft_tokens, [b for b in graphs.buckets if b <= largest])


class DraftHeadProposer:
    def __init__(
        self, head: DraftHead, model: CausalLM, fused_kernels: bool, graphs: HeadProposalGraphs | None = None
    ) -> None:
        """`graphs`: the proposal graphs to replay where they apply (None: every proposal runs eagerly)."""
        self.head, self.model, self.fused_kernels, self.graphs = head, model, fused_kernels, graphs
        self.draws = 0

    def propose(
        self, reqs: list[Request], ks: list[int], hidden: torch.Tensor, rows: list[int]
    ) -> list[list[int]]:
        """ks[i] draft tokens to follow each request's sequence, from row rows[i] of `hidden` (the model's
        hidden state at the request's next-to-last position)."""
        if not reqs:
            return []
        device = self.head.device
        index = host_to_device(np.asarray(rows, dtype=np.int64), device)
        tokens = host_to_device(np.asarray([req.output_ids[-1] for req in reqs], dtype=np.int64), device)
        draws = DraftDraws(reqs, self.model.args.vocab_size, device, self.fused_kernels)
        steps = max(ks)  # every request takes max(ks) steps (ks differ only near a request's end)
        with fused.fused_kernels(self.fused_kernels):
            drafts = self._replay(hidden, index, tokens, draws, steps)
            if drafts is None:
                drafts = self._eager(hidden[index], tokens, draws, steps)
        self.draws += steps
        return [row[:k] for row, k in zip(drafts.tolist(), ks)]  # the one read of the proposal

    def _eager(
        self, state: torch.Tensor, tokens: torch.Tensor, draws: DraftDraws, steps: int
    ) -> torch.Tensor:
        embed, lm_head = self.model.model.embed_tokens, self.model.lm_head
        columns = []
        for step in range(steps):
            state = self.head(state, embed(tokens))
            tokens = draws.sample(lm_head(state), None, step)
            columns.append(tokens)
        return torch.stack(columns, dim=1)

    def _replay(
        self, hidden: torch.Tensor, index: torch.Tensor, last: torch.Tensor, draws: DraftDraws, steps: int
    ) -> torch.Tensor | None:
        """[n, >= steps] the proposal's tokens from the graphs, or None where they do not apply."""
        graphs = self.graphs
        st = draws.settings
        if graphs is None or steps > graphs.steps or not (st.all_greedy or plain_draw(st, self.head.device)):
            return None
        uniform = None if st.all_greedy else draws.uniforms(graphs.steps)
        return graphs.propose(hidden, index, last, st, uniform)
