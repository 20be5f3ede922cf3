"""CUDA graphs of the sampler's plain draw on the decode (and verify) graphs' logits.

A plain draw is the sampler's most common case in RL: temperature only, no top-k / top-p / min-p, no greedy row
(`sampler.sample` then draws from block totals, `draws_from_block_masses`). Eagerly it launches ~30 small
kernels a step: ~0.86 ms of host time on the H200's host, a third of a `qwen3-0.6b` decode step at batch 64,
where the host is the bottleneck. Replayed as a graph on a decode (or verify) graph's static logits it is one launch.

A graph is captured per logits buffer (so per bucket), right after the decode or verify graph that writes it,
in the same memory pool; it computes the same kernels on the same inputs, so its tokens and logprobs are the
eager ones bit for bit. `CudaGraphRunner` owns the graphs and drops them with its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from miles.models import fused
from miles.rollout.sampling import triton_kernel
from miles.rollout.sampling.sampler import SamplingTensors, draws_from_block_masses, sample

log = logging.getLogger(__name__)

SAMPLE_BLOCK_GPU = 256
"""Rows sampled at once on GPU (bounds the [rows, vocab] temporaries; the block-total unfiltered draw has none
and samples every row at once unless greedy rows, which take a [rows, vocab] log-softmax, are mixed in)."""


def sample_rows(
    logits: torch.Tensor, st: SamplingTensors, graphs: Any | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(tokens, logprobs, whether a sampler graph drew them) over a forward's logits rows. `graphs` (the
    runner's `CudaGraphRunner`, or None) replays its sampler graph where the logits are its last replay's
    and every row takes the plain draw; on CUDA a draw that needs full-vocabulary temporaries goes in blocks
    of rows; otherwise one eager call."""
    if graphs is not None and (graphed := graphs.sample(logits, st)) is not None:
        return graphed[0], graphed[1], True
    num = logits.shape[0]
    if (
        logits.device.type == "cuda"
        and num > SAMPLE_BLOCK_GPU
        and (st.any_greedy or not draws_from_block_masses(st, logits.device))
    ):
        out = [
            sample(logits[i : i + SAMPLE_BLOCK_GPU], st.rows(slice(i, i + SAMPLE_BLOCK_GPU)))
            for i in range(0, num, SAMPLE_BLOCK_GPU)
        ]
        return torch.cat([t for t, _ in out]), torch.cat([lp for _, lp in out]), False
    tokens, logprobs = sample(logits, st)
    return tokens, logprobs, False


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    temperature: torch.Tensor
    """[bucket] float32 input; rows past the step's are padding (any positive temperature)."""
    uniform: torch.Tensor
    """[bucket] float64 input."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    triton: bool
    """Whether the sampler's Triton kernel was on at capture: once it switches off, the eager sampler takes
    the compiled path, and so must every draw (the two agree only up to rounding)."""
    copied_from: torch.Tensor | None = None
    """The step temperatures last copied in (kept per params object by the engine: copied again only when
    that object, or the number of rows, changes)."""
    copied_rows: int = 0


def plain_draw(st: SamplingTensors, device: torch.device) -> bool:
    """Whether the step's rows all take the plain draw (the one the graphs capture)."""
    return not st.any_greedy and draws_from_block_masses(st, device)


class SamplerGraphs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.on = True
        """Off after a capture failed: the eager sampler runs from then on."""

    def reset(self) -> None:
        self.captured.clear()

    def sample(
        self, logits: torch.Tensor, rows: int, st: SamplingTensors
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens [rows], logprobs [rows]) of the plain draw over the first `rows` rows of `logits`, a decode
        graph's static [bucket, V] output, with `st`'s settings; None where no graph was captured for it (the
        caller samples eagerly)."""
        captured = self.captured.get((logits.data_ptr(), logits.shape[0]))
        if captured is None or captured.triton != triton_kernel.kernel.on:
            return None
        if captured.copied_from is not st.temperature or captured.copied_rows != rows:
            captured.temperature[:rows].copy_(st.temperature)
            captured.copied_from, captured.copied_rows = st.temperature, rows
        captured.uniform[:rows].copy_(st.uniform)
        captured.graph.replay()
        # A copy of the tokens: the next step reads them (overlap scheduling) after later replays. The
        # logprobs are a view of the graph's output: the caller must read them (enqueue the kernel that does)
        # before any other graph replays, which may reuse that memory.
        return captured.tokens[:rows].clone(), captured.logprobs[:rows]

    def capture(self, logits: torch.Tensor, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        """Capture the plain draw over a decode or verify graph's static `logits` [rows, V] (in that graph's memory
        `pool`, on its capture `stream`), where the sampler would take it (fused kernels on)."""
        bucket = logits.shape[0]
        if not self.on or not fused.compiling():
            return
        temperature = torch.ones(bucket, dtype=torch.float32, device=self.device)
        uniform = torch.full((bucket,), 0.5, dtype=torch.float64, device=self.device)
        # The settings the graph is captured for; only the tensors' values change at replay.
        st = SamplingTensors(
            temperature=temperature,
            top_k=torch.empty(0, dtype=torch.int64, device=self.device),  # unread by the plain draw
            top_p=torch.empty(0, dtype=torch.float32, device=self.device),
            min_p=torch.empty(0, dtype=torch.float32, device=self.device),
            uniform=uniform,
            any_greedy=False,
            all_greedy=False,
            any_filter=False,  # (the plain draw divides by the temperature whatever `unit_temperature` says)
        )
        try:
            # Two eager draws on the capture stream first (compiles, autotunes, allocates).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                sample(logits, st)
                sample(logits, st)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            triton = triton_kernel.kernel.on
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                tokens, logprobs = sample(logits, st)
        except Exception as err:  # e.g. a kernel that cannot be captured: the eager sampler still works
            self.on = False
            self.captured.clear()
            log.warning("sampler CUDA graph capture failed (%s); sampling eagerly from now on", err)
            return
        self.captured[(logits.data_ptr(), bucket)] = _Captured(
            graph, temperature, uniform, tokens, logprobs, triton and triton_kernel.kernel.on
        )
