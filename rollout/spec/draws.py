"""How a draft token is drawn, for both kinds of draft (draft_model.py, head.py).

Each draft token is drawn with the uniform number plain decoding uses at that response position and the
request's own sampling settings (sampling/sampler.py), from the draft's distribution. Verification keeps the
target's draws, so the samples stay exactly plain decoding's whatever the draft; sharing the random number
couples the two inverse-CDF draws, so a draft whose distribution is close to the target's proposes the very
token the target then samples, at any temperature, not only under greedy decoding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.models import fused
from miles.rollout.forward_batch import host_to_device
from miles.rollout.request import Request
from miles.rollout.sampling.graph import sample_rows
from miles.rollout.sampling.sampler import SamplingTensors, mix_seeds, uniforms_of_mixed

if TYPE_CHECKING:
    from miles.rollout.cuda_graph import CudaGraphRunner


class DraftDraws:
    """The sampling settings of one proposal's requests, built once: each draw takes a subset of them and
    the uniform numbers plain decoding uses at its response positions."""

    def __init__(
        self,
        reqs: list[Request],
        vocab_size: int,
        device: torch.device,
        fused_kernels: bool,
        graphs: CudaGraphRunner | None = None,
    ) -> None:
        """`graphs`: the CUDA graphs whose sampler graphs a draw on their logits may replay."""
        params = [r.params for r in reqs]
        self.count, self.device, self.fused_kernels, self.graphs = len(reqs), device, fused_kernels, graphs
        self.made = self.graphed = 0
        """Draws made, and those that replayed a sampler graph (sampling/graph.py)."""
        self.mixed = mix_seeds([r.seed for r in reqs])
        self.outputs = np.fromiter((len(r.output_ids) for r in reqs), np.uint64, len(reqs))
        self.settings = SamplingTensors.build(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            np.zeros(len(reqs)),
            vocab_size,
            device,
        )

    def uniforms(self, steps: int) -> np.ndarray:
        """[requests, steps] the uniform numbers of every request's next `steps` draws (offsets 0, 1, ...)."""
        offsets = np.arange(steps, dtype=np.uint64)
        return uniforms_of_mixed(self.mixed[:, None], self.outputs[:, None] + offsets[None, :])

    def sample(self, logits: torch.Tensor, picked: list[int] | None, offset: int) -> torch.Tensor:
        """Tokens of `logits` row i for request picked[i] (None: every request, in order) at response position
        len(output) + offset."""
        self.made += 1
        index = np.arange(self.count) if picked is None else np.asarray(picked, dtype=np.int64)
        uniform = uniforms_of_mixed(self.mixed[index], self.outputs[index] + np.uint64(offset))
        rows = (
            self.settings
            if len(index) == self.count
            else self.settings.rows(host_to_device(index, self.device))
        )
        rows = replace(rows, uniform=host_to_device(uniform, self.device))
        # As the engine samples: on a decode graph's logits a plain draw replays the sampler graph captured
        # with it (one launch where the eager sampler makes ~30, the same kernels, so the same tokens), and
        # on CUDA draws that need [rows, vocab] temporaries go in blocks of rows.
        with fused.fused_kernels(self.fused_kernels):
            tokens, _, graphed = sample_rows(logits, rows, self.graphs)
        self.graphed += graphed
        return tokens
