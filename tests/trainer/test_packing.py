"""Packing: a micro-batch's per-token tensors against their per-sample definitions."""

from __future__ import annotations

import random

import torch

from miles.sample import Sample
from miles.trainer.packing import build_micro_batch, pack


def test_micro_batch_fields_follow_each_sample() -> None:
    rng = random.Random(0)
    samples = [
        Sample(
            prompt_ids=[rng.randrange(100) for _ in range(rng.randint(1, 9))],
            response_ids=[rng.randrange(100) for _ in range(rng.randint(1, 6))],
        )
        for _ in range(12)
    ]
    order = rng.sample(range(len(samples)), len(samples))
    batches = pack(samples, order, 16, torch.device("cpu"))
    assert sorted(i for b in batches for i in b.sample_ids) == list(range(len(samples)))
    for batch in batches:
        start, begin = 0, 0
        for local, i in enumerate(batch.sample_ids):
            s = samples[i]
            fed = s.prompt_ids + s.response_ids[:-1]
            end, stop = start + len(fed), begin + len(s.response_ids)
            assert batch.cu_seqlens[local : local + 2] == [start, end]
            assert batch.input_ids[start:end].tolist() == fed
            assert batch.positions[start:end].tolist() == list(range(len(fed)))
            # The logits at the last prompt position and each fed response position predict the response.
            rows = list(range(start + len(s.prompt_ids) - 1, end))
            assert batch.target_rows[begin:stop].tolist() == rows
            assert batch.targets[begin:stop].tolist() == s.response_ids
            assert batch.seq_index[begin:stop].tolist() == [local] * len(s.response_ids)
            assert batch.response_lengths[local] == len(s.response_ids)
            start, begin = end, stop
        assert batch.num_tokens == start and batch.targets.numel() == begin
        assert batch.input_ids.dtype == batch.target_rows.dtype == torch.long


def test_empty_micro_batch() -> None:
    batch = build_micro_batch([], [], torch.device("cpu"))
    assert batch.cu_seqlens == [0] and batch.num_tokens == 0 and batch.response_lengths == []
