"""The engine's step state: a launched step whose results are still on the device (`LaunchedStep`), what
carries over from one step to the next (`StepLoop`), and what one step collects as it runs (`StepRun`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from miles.rollout.request import Request
from miles.rollout.sampling.rows import Alternatives
from miles.rollout.scheduler import Chunk
from miles.rollout.spec.head import ChainedDrafts
from miles.sample import Sample


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its tokens are read by `Engine._resolve`."""

    chunks: list[Chunk]
    extend: list[bool]
    """Per chunk: it computes prompt (or recomputed) tokens, so its prefix goes into the radix cache."""
    sampled: list[Chunk]
    """The chunks that sample, then one empty chunk per fork (`StepPlan.forks`), in sample-row order."""
    forks: list[Request]
    num_tokens: int
    """Tokens the forward computed."""
    kv_tokens: int
    """Tokens attended (each chunk's end position), for the decode roofline."""
    tokens: torch.Tensor | None = None
    """[S] the sampled token ids on the device (the next step's decode inputs are gathered from it)."""
    host: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
    """[2, S] float64 tokens and logprobs, copied to (pinned) host memory behind the step; on CPU the
    (tokens, logprobs) tensors themselves. None: the step samples nothing."""
    done: torch.cuda.Event | None = None
    """Recorded after that copy (CUDA); None when the copy is synchronous."""
    alternatives: Alternatives | None = None
    """The most likely tokens of the rows whose requests asked for `top_logprobs`."""
    hidden: torch.Tensor | None = None
    """[S, hidden] the sample rows' final-norm hidden states, in `sampled` order (kept for a draft head)."""
    chained: ChainedDrafts | None = None
    """A verify step's next drafts, proposed by the draft head behind it on the device."""

    def keep_results(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, alternatives: Alternatives | None
    ) -> None:
        """The sampled tokens, their logprobs and the alternatives, for `read`: on CUDA copied to pinned host
        memory behind the step (an event recorded after the copy); on CPU the tensors themselves, read by
        `tolist` at once (no [2, S] float64 copy to make)."""
        self.tokens, self.alternatives = tokens, alternatives
        if tokens.device.type != "cuda":
            self.host = (tokens, logprobs)
            return
        values = torch.stack([tokens.double(), logprobs.double()])
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self.host.copy_(values, non_blocking=True)
        if alternatives is not None:
            pinned = torch.empty(alternatives.values.shape, dtype=torch.float64, pin_memory=True)
            pinned.copy_(alternatives.values, non_blocking=True)
            self.alternatives = Alternatives(alternatives.rows, pinned)
        self.done = torch.cuda.Event()
        self.done.record()

    def read(self) -> ReadBack:
        """Wait for the step's results (its own copy, not whatever was queued after it) and read them."""
        waited = 0.0
        if self.done is not None:
            start = time.perf_counter()
            self.done.synchronize()
            waited = time.perf_counter() - start
        assert self.host is not None
        tokens, logprobs = (values.tolist() for values in self.host)
        alternatives = {}
        if self.alternatives is not None:
            alternatives = dict(zip(self.alternatives.rows, zip(*self.alternatives.values.tolist())))
        return ReadBack(tokens, logprobs, alternatives, waited)


@dataclass
class ReadBack:
    """A launched step's results on the host."""

    tokens: list[float]
    """Per sample row, the token id (a float on CUDA: the copy is float64)."""
    logprobs: list[float]
    alternatives: dict[int, tuple[list[float], list[float]]]
    """Sample row -> the ids and logprobs of its most likely tokens (rows that asked for them only)."""
    waited_s: float
    """Host time spent waiting for the device."""


@dataclass
class StepLoop:
    """What carries over from one engine step to the next."""

    in_flight: LaunchedStep | None = None
    """Overlap scheduling: the launched step whose tokens are not read yet."""
    drained: list[Sample] = field(default_factory=list)
    """Samples that finished while a step in flight was read between steps (weights, memory): the next
    `step` returns them."""
    abort_requested: bool = False
    """`Engine.abort` flagged a request since the last step."""
    maybe_stalled: bool = False
    """The last plan left a running request out: its max_new_tokens may have been lowered to its output."""
    progressed: bool = False
    """The last step launched or read a forward (`generate` tells a stalled scheduler by it)."""


@dataclass
class StepRun:
    """What one step collects as it runs."""

    started: float
    """`time.perf_counter()` when the step began."""
    finished: list[Sample]
    """Samples finished so far, in order."""
    drafted: bool = False
    """Some running request carries a draft: the step's own tokens are read before it returns, since the
    next step's inputs depend on how many drafts are kept."""
