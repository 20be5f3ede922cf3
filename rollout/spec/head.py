"""Draft tokens from a draft head over the model's hidden states (`rollout.speculative=head`).

The head (miles/models/draft_head.py) starts from the model's final-norm hidden state at the row whose logits
the request's last token was sampled from (the engine keeps the last step's: `ModelRunner.last_hidden`)
and that token's embedding; each of its k steps gives logits through the model's LM head, a draft token
drawn from them as draws.py says, and the state the next step starts from. A request that was not in
the last step has no hidden state to start from and gets no draft this step. Nothing is cached between
proposals, so nothing has to be dropped when requests leave, retract, or the head's weights change. With CUDA
graphs on, a proposal whose rows all take the plain draw, or are all greedy, replays the k steps as one graph
(head_graph.py).

Behind a verify step whose requests all verified drafts of one length, the next proposal is chained on the
device (`chain`): which drafts each request keeps is computed there from the sampled tokens, so the head
starts from the row and token the host's acceptance will keep, without waiting for the host to read them.
The host reads the verify step's tokens first (the proposal still runs), then the drafts with the next
step's proposal: a proposal's host work and one device round trip leave the critical path of a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.config import RolloutConfig
from miles.models import fused
from miles.models.draft_head import DraftHead, load_draft_head, new_draft_head
from miles.models.model import CausalLM
from miles.rollout.forward_batch import host_to_device
from miles.rollout.request import Request
from miles.rollout.sampling.graph import plain_draw, sample_rows
from miles.rollout.sampling.sampler import SamplingTensors, mix_seeds, uniforms_of_mixed
from miles.rollout.spec.draws import DraftDraws
from miles.rollout.spec.head_graph import HeadProposalGraphs

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


@dataclass
class ChainedDrafts:
    """Drafts proposed on the device behind a verify step (`DraftHeadProposer.chain`)."""

    rids: list[int]
    """The verify step's requests, in row order."""
    lengths: list[int]
    """Their output lengths before the verify step."""
    values: torch.Tensor
    """[n, 1 + steps] int64, on the host once `done` has passed: the drafts each request accepted (as the
    device counted them), then the next proposal's tokens."""
    done: torch.cuda.Event | None
    """Recorded after the copy to the host (CUDA); None where the copy was synchronous."""

    def read(self) -> dict[int, tuple[int, list[int]]]:
        """Request id -> (the output length the drafts follow, the drafts)."""
        if self.done is not None:
            self.done.synchronize()
        return {
            rid: (length + 1 + row[0], row[1:])
            for rid, length, row in zip(self.rids, self.lengths, self.values.tolist())
        }


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
        graphs = self.graphs
        drawn = graphs.steps if graphs is not None and steps <= graphs.steps else steps  # a graph draws all
        uniform = None if draws.settings.all_greedy else host_to_device(draws.uniforms(drawn), device)
        drafts = self._proposal(hidden, index, tokens, draws.settings, uniform, steps)
        return [row[:k] for row, k in zip(drafts.tolist(), ks)]  # the one read of the proposal

    def chain(
        self,
        hidden: torch.Tensor,
        sampled: torch.Tensor,
        inputs: torch.Tensor,
        reqs: list[Request],
        st: SamplingTensors,
        steps: int,
    ) -> ChainedDrafts | None:
        """Queue the proposal that follows a verify step, before its tokens are read: `hidden` and `sampled`
        are its [n * (1 + k), ...] sample rows' hidden states and tokens, `inputs` its input ids (each
        request's last token, then its k drafts), `reqs` its n requests, `st` its rows' sampling settings.
        Request i keeps its tokens up to the first sampled one that differs from its draft (engine
        `_accept`); its next `steps` drafts start from the row that token was sampled from, drawn with the
        uniform numbers of the response positions after it. None where no proposal is made (out of memory:
        the next step proposes as usual)."""
        n, device = len(reqs), self.head.device
        width = sampled.shape[0] // n
        try:
            sampled, drafted = sampled.view(n, width), inputs.view(n, width)[:, 1:]
            accepted = (sampled[:, :-1] == drafted).cumprod(dim=1).sum(dim=1)
            last = sampled.gather(1, accepted[:, None]).squeeze(1)
            rows = torch.arange(n, device=device) * width + accepted
            lengths = [len(req.output_ids) for req in reqs]
            uniform = None
            if not st.all_greedy:  # the positions after any number of accepted drafts, picked on the device
                offsets = np.arange(width + steps - 1, dtype=np.uint64)
                mixed = mix_seeds([req.seed for req in reqs])
                after = np.asarray(lengths, dtype=np.uint64)[:, None] + np.uint64(1) + offsets[None, :]
                every = host_to_device(uniforms_of_mixed(mixed[:, None], after), device)
                uniform = every.gather(1, accepted[:, None] + torch.arange(steps, device=device)[None, :])
            per_request = st.rows(slice(None, None, width))
            drafts = self._proposal(hidden, rows, last, per_request, uniform, steps)
            values = torch.cat((accepted[:, None], drafts[:, :steps]), dim=1)
            done = None
            if device.type == "cuda":
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                values = host.copy_(values, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        except torch.cuda.OutOfMemoryError:
            return None
        return ChainedDrafts([req.rid for req in reqs], lengths, values, done)

    def _proposal(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        last: torch.Tensor,
        st: SamplingTensors,
        uniform: torch.Tensor | None,
        steps: int,
    ) -> torch.Tensor:
        """[n, >= steps] draft tokens from rows `rows` of `hidden` after tokens `last` (device int64 [n]),
        drawn as `st` says with `uniform` ([n, >= steps] on the device; None when every row is greedy):
        replayed as a graph where one applies (`uniform` as wide as its steps), else eagerly."""
        graphs = self.graphs
        self.draws += steps
        with fused.fused_kernels(self.fused_kernels):
            if (
                graphs is not None
                and steps <= graphs.steps
                and (uniform is None or uniform.shape[1] == graphs.steps)
                and (st.all_greedy or plain_draw(st, self.head.device))
            ):
                drafts = graphs.propose(hidden, rows, last, st, uniform)
                if drafts is not None:
                    return drafts
            embed, lm_head = self.model.model.embed_tokens, self.model.lm_head
            state, tokens, columns = hidden[rows], last, []
            for step in range(steps):
                state = self.head(state, embed(tokens))
                column = st if uniform is None else replace(st, uniform=uniform[:, step].contiguous())
                tokens, _, _ = sample_rows(lm_head(state), column, None)
                columns.append(tokens)
            return torch.stack(columns, dim=1)
