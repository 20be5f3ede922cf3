"""CUDA graphs of a draft head's proposal (`rollout.speculative=head`): its k steps as one launch.

Eagerly each step of a proposal is ~40 kernel launches (the head's norms and projections, the embedding, the
LM head, the sampler's plain draw) and a host-built uniform vector: on the H200's host ~1.7 ms a step for 32
requests of a Qwen3-8B shape, where the GPU needs ~0.4 ms (docs/benchmarks.md, "Draft heads"). Captured per
batch bucket, the k steps replay as one graph on static inputs: the start hidden states (gathered from the
last step's rows), the last tokens, the rows' temperatures, and the k uniform numbers each row draws with.

Graphs cover proposals whose rows all take the plain draw (sampling/graph.py: temperature > 0, no top-k / top-p /
min-p) or are all greedy, each kind captured at its first proposal, and batches up to the verify graphs'
largest (speculation pays at those sizes only); other proposals run eagerly. A replay
draws with the eager sampler's kernels, on logits computed at the padded bucket's shapes, which may round
differently from an eager proposal's: the drafts can differ at a near tie, the samples never (verification
keeps the target's draws).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from miles.models.draft_head import DraftHead
from miles.models.model import CausalLM
from miles.rollout.sampling.sampler import SamplingTensors, sample

log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    """[bucket, steps] int64 output: row i's draft tokens."""


class HeadProposalGraphs:
    def __init__(self, head: DraftHead, model: CausalLM, steps: int, buckets: list[int]) -> None:
        """Graphs of `steps`-token proposals for batches of up to max(buckets) requests."""
        self.head, self.model, self.steps, self.buckets = head, model, steps, sorted(buckets)
        self.captured: dict[tuple[int, bool], _Captured] = {}
        """(bucket, greedy) -> its graph."""
        self.on = True
        """Off after a capture failed: proposals run eagerly from then on."""
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def propose(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        last: torch.Tensor,
        st: SamplingTensors,
        uniform: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """[n, steps] draft tokens from rows `rows` (device int64 [n]) of `hidden`, after tokens `last` (device
        int64 [n]), drawn as `st` says (every row greedy, uniform None; or every row the plain draw with its temperature
        and `uniform` [n, steps] float64, on the host or the device); None where no graph can replay it (the
        caller proposes eagerly)."""
        n, greedy = rows.shape[0], st.all_greedy
        if not self.on or n > self.max_batch:
            return None
        if (self.max_batch, greedy) not in self.captured:
            self._capture_all(hidden.dtype, greedy)
            if not self.on:
                return None
        bucket = next(b for b in self.buckets if b >= n)
        torch.index_select(hidden, 0, rows, out=self.state[:n])
        self.tokens[:n].copy_(last)
        if uniform is not None:  # (greedy rows draw none)
            self.temperature[:n].copy_(st.temperature)
            self.uniform[:n].copy_(uniform, non_blocking=True)
        captured = self.captured[(bucket, greedy)]
        captured.graph.replay()
        self.replays += 1
        return captured.tokens[:n]

    def _capture_all(self, dtype: torch.dtype, greedy: bool) -> None:
        device, h, top = self.head.device, self.head.args.hidden_size, self.max_batch
        if not self.captured:
            # Padding rows keep whatever an earlier replay left (finite states, positive temperatures).
            self.state = torch.zeros(top, h, dtype=dtype, device=device)
            self.tokens = torch.zeros(top, dtype=torch.int64, device=device)
            self.temperature = torch.ones(top, dtype=torch.float32, device=device)
            self.uniform = torch.full((top, self.steps), 0.5, dtype=torch.float64, device=device)
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)  # one stream: the graphs share the pool's freed blocks
        pool, stream = self.pool, self.stream
        try:
            for bucket in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # compiles, autotunes, allocates before the capture
                    self._steps(bucket, greedy)
                    self._steps(bucket, greedy)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    tokens = self._steps(bucket, greedy)
                self.captured[(bucket, greedy)] = _Captured(graph, tokens)
        except Exception as err:  # a kernel that cannot be captured, or no memory for the graphs
            self.on = False
            self.captured.clear()
            log.warning("draft head CUDA graph capture failed (%s); proposing eagerly from now on", err)
            torch.cuda.empty_cache()
        torch.cuda.synchronize(device)

    def _steps(self, bucket: int, greedy: bool) -> torch.Tensor:
        """The proposal over the first `bucket` rows of the static inputs, as the eager one runs it
        (DraftHeadProposer.propose)."""
        empty_i, empty_f = (
            torch.empty(0, dtype=d, device=self.state.device) for d in (torch.int64, torch.float32)
        )
        st = SamplingTensors(
            temperature=self.temperature[:bucket],
            top_k=empty_i,  # unread by the plain draw
            top_p=empty_f,
            min_p=empty_f,
            uniform=self.uniform[:bucket, 0],
            any_greedy=greedy,
            all_greedy=greedy,
            any_filter=False,
        )
        embed, lm_head = self.model.model.embed_tokens, self.model.lm_head
        state, tokens, columns = self.state[:bucket], self.tokens[:bucket], []
        for step in range(self.steps):
            state = self.head(state, embed(tokens))
            tokens, _ = sample(lm_head(state), replace(st, uniform=self.uniform[:bucket, step].contiguous()))
            columns.append(tokens)
        return torch.stack(columns, dim=1)
