"""`build_batch`: a step's scheduled chunks as one packed `ForwardBatch`, with KV slots allocated for the
tokens it computes."""

from __future__ import annotations

import numpy as np
import torch

from miles.rollout.forward_batch import ForwardBatch, concat_ranges, host_to_device
from miles.rollout.kv.manager import KVManager
from miles.rollout.scheduler import Chunk


def build_batch(
    chunks: list[Chunk],
    kv: KVManager,
    device: torch.device,
    prefix_groups: bool = False,
    plain_decode: bool = False,
) -> ForwardBatch:
    """`prefix_groups`: carry the requests' shared-prefix groups (`ForwardBatch.prefix_groups`, read by the
    CPU attention); `plain_decode`: every chunk is a running request's next token (`StepPlan.plain_decode`).
    A token still on the device is fed as its placeholder (-1): the engine puts it in place."""
    count = len(chunks)
    reqs = [c.req for c in chunks]
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=count)
    every_token_samples = plain_decode or all(c.length == 1 and c.samples for c in chunks)
    verify_len = 0
    if every_token_samples:  # decode-shaped: one token each, all sample
        # Each feeds its sequence's last token.
        ids = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        lens = np.ones(count, dtype=np.int64)
        positions = starts
        sample_index = torch.arange(count, device=device)
    else:
        ids = []
        rows_with_logits: list[int] = []
        for c in chunks:
            ids.extend(c.req.tokens(c.start, c.start + c.length - len(c.draft)))
            ids.extend(c.draft)
            rows_with_logits.extend(range(len(ids) - c.sample_rows, len(ids)))
        lens = np.fromiter((c.length for c in chunks), dtype=np.int64, count=count)
        positions = concat_ranges(starts, lens)
        sample_index = host_to_device(torch.tensor(rows_with_logits, dtype=torch.long), device)
        first = chunks[0].length
        if first > 1 and all(c.draft and c.samples and c.length == first == c.sample_rows for c in chunks):
            verify_len = first
    rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=count)
    out_slots = kv.alloc_extend(rows, starts, lens)
    # Token ids and positions in one copy to the device (np.array of a list is faster than torch.tensor).
    input_ids, device_positions = host_to_device(np.stack([np.array(ids, dtype=np.int64), positions]), device)
    return ForwardBatch(
        input_ids=input_ids,
        positions=device_positions,
        out_slots=out_slots,
        rows=rows.tolist(),
        q_lens=lens.tolist(),
        kv_lens=(starts + lens).tolist(),
        sample_index=sample_index,
        # Requests pinned to the same radix node share their first prefix_len slots (read by the CPU
        # attention only, which attends to a shared prefix once per group).
        prefix_groups=[id(r.node) if r.node is not None else -1 for r in reqs] if prefix_groups else None,
        prefix_lens=[r.prefix_len for r in reqs] if prefix_groups else None,
        every_token_samples=every_token_samples,
        verify_len=verify_len,
    )
