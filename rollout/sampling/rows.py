"""`RowSampler`: how the engine samples a step's logits rows, each for one request at one position.

Each row draws with its request's settings and with the uniform number of its request's seed at its
position in the response (sampler.py), so a sample does not depend on its batch and a draft row draws what
plain decoding would draw there. A step usually has the rows of the step before (the same requests, one
token further, sharing one `SamplingParams`): their seeds and settings' tensors are then reused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from miles.models import fused
from miles.rollout.forward_batch import host_to_device
from miles.rollout.request import Request
from miles.rollout.sampling.graph import sample_rows
from miles.rollout.sampling.params import SamplingParams
from miles.rollout.sampling.sampler import (
    SamplingTensors,
    mix_seeds,
    sample,
    top_alternatives,
    uniforms_of_mixed,
)

if TYPE_CHECKING:
    from miles.rollout.model_runner import ModelRunner


class RowSettings(NamedTuple):
    """What of a request's params its sampling row needs."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float

    @classmethod
    def of(cls, p: SamplingParams) -> RowSettings:
        return cls(p.temperature, p.top_k, p.top_p, p.min_p)


@dataclass
class Alternatives:
    """The most likely tokens of the sample rows whose requests asked for `top_logprobs`."""

    rows: list[int]
    """Those rows, in sample-row order."""
    values: torch.Tensor
    """[2, rows, count] float64 ids and logprobs (in host memory on CUDA, copied behind the step)."""


@dataclass
class _KeptSettings:
    """The last step's rows' params, each distinct one with its settings, and their tensors: reused while
    the rows have the same params with the same values (checked by value: a caller may change a
    SamplingParams in place between calls)."""

    params: list[SamplingParams]
    distinct: list[tuple[SamplingParams, RowSettings]]
    tensors: SamplingTensors


@dataclass
class _KeptSeeds:
    """The last step's sampling requests and their mixed seeds (`sampler.mix_seeds`)."""

    reqs: list[Request]
    mixed: np.ndarray


class RowSampler:
    def __init__(self, runner: ModelRunner, vocab_size: int, deterministic: bool, det_chunk: int) -> None:
        """`runner`: the model runner whose logits are sampled (its fused-kernel switch and sampler graphs);
        `deterministic`: sample in fixed blocks of `det_chunk` rows, as the forward runs."""
        self.runner, self.vocab_size = runner, vocab_size
        self.device = runner.pool.device
        self.deterministic, self.det_chunk = deterministic, det_chunk
        self._settings: _KeptSettings | None = None
        self._seeds: _KeptSeeds | None = None

    def forget(self) -> None:
        """Nothing runs: the requests kept for their seeds may go."""
        self._seeds = None

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], offsets: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, SamplingTensors]:
        """Row i samples response position len(output) + offsets[i] of request reqs[i] (offsets None: all 0):
        offsets > 0 are draft rows, whose uniform numbers are the ones plain decoding would use there, so
        speculation changes no sample. Returns the tokens, their logprobs and the rows' settings."""
        if self._seeds is None or self._seeds.reqs != reqs:  # the same requests as last step: kept
            self._seeds = _KeptSeeds(reqs, mix_seeds([r.seed for r in reqs]))
        positions = np.fromiter((len(r.output_ids) for r in reqs), dtype=np.uint64, count=len(reqs))
        if offsets is not None:
            positions += offsets
        uniform = uniforms_of_mixed(self._seeds.mixed, positions)
        params = [r.params for r in reqs]
        kept = self._settings
        # Reused while the rows have the same params with the same values (typically one shared object).
        if (
            kept is not None
            and kept.params == params
            and all(RowSettings.of(p) == v for p, v in kept.distinct)
        ):
            st = replace(kept.tensors, uniform=host_to_device(uniform, self.device))
        else:
            temperature, top_k, top_p, min_p = (list(column) for column in zip(*map(RowSettings.of, params)))
            st = SamplingTensors.build(
                temperature, top_k, top_p, min_p, uniform, self.vocab_size, self.device
            )
            distinct = {id(p): p for p in params}.values()
            self._settings = _KeptSettings(params, [(p, RowSettings.of(p)) for p in distinct], st)
        with fused.fused_kernels(self.runner.fused_kernels):
            return (*self._sample_rows(logits, st), st)

    def _sample_rows(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        num = logits.shape[0]
        if not self.deterministic:
            tokens, logprobs, _ = sample_rows(logits, st, self.runner.graphs)
            return tokens, logprobs
        # Deterministic mode: fixed row blocks, padded, as for the forward.
        block = self.det_chunk
        padded = F.pad(logits, (0, 0, 0, (-num) % block))
        st_pad = SamplingTensors(
            *(
                F.pad(t, (0, (-num) % block))
                for t in (st.temperature, st.top_k, st.top_p, st.min_p, st.uniform)
            ),
            st.any_greedy,
            st.all_greedy,
            st.any_filter,
        )
        out = [
            sample(padded[i : i + block], st_pad.rows(slice(i, i + block)))
            for i in range(0, padded.shape[0], block)
        ]
        return torch.cat([t for t, _ in out])[:num], torch.cat([lp for _, lp in out])[:num]

    def alternatives(self, logits: torch.Tensor, reqs: list[Request]) -> Alternatives | None:
        """The most likely tokens of the sample rows whose requests asked for `top_logprobs` (None for a step
        without them)."""
        rows = [i for i, req in enumerate(reqs) if req.params.top_logprobs]
        if not rows:
            return None
        params = [reqs[i].params for i in rows]
        st = SamplingTensors.build(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            np.zeros(len(rows)),
            self.vocab_size,
            self.device,
        )
        picked = logits if len(rows) == len(reqs) else logits[host_to_device(np.asarray(rows), self.device)]
        ids, values = top_alternatives(picked, st, max(p.top_logprobs for p in params))
        return Alternatives(rows, torch.stack([ids.double(), values.double()]))
