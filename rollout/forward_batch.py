"""`ForwardBatch`: the packed tokens of one engine step and where their keys and values live."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def concat_ranges(starts: np.ndarray, counts: np.ndarray, step: int = 1) -> np.ndarray:
    """[starts[0], starts[0] + step, ... (counts[0] values), starts[1], ...]: per-token positions of packed runs."""
    starts, counts = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + within * step


def host_to_device(values: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host values on `device` through a non-blocking copy: a blocking one synchronises the stream, so the
    host would wait for the step in flight every step (overlap scheduling). From pageable memory the driver
    stages the values before returning, so they may be freed right after. (Staging through `pin_memory()`
    first measured no faster on the H200, with more host work per step.)"""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    return host.to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] token ids of every sequence's new tokens, packed."""
    positions: torch.Tensor
    """[N] their positions."""
    out_slots: torch.Tensor
    """[N] KV slots the new tokens' keys and values go to."""
    rows: list[int]
    """[B] request-table row of each sequence."""
    q_lens: list[int]
    """[B] new tokens per sequence."""
    kv_lens: list[int]
    """[B] cached + new tokens per sequence (what each attends over)."""
    sample_index: torch.Tensor
    """[S] indices into the N tokens whose logits are needed (the last token of sampling sequences)."""
    prefix_groups: list[int] | None = None
    """[B] sequences with the same id share the KV slots of their first `prefix_lens` positions (-1: none)."""
    prefix_lens: list[int] | None = None
    """[B] length of that shared (radix-cached) prefix."""
    every_token_samples: bool = False
    """`sample_index` is all N tokens in order (a plain decode step), so the logits need no row gather."""
    verify_len: int = 0
    """A verify step (speculative decoding) in which every sequence feeds its last token and the same number
    of drafts, and every row samples: those rows per sequence (sample_index is then all N tokens in order);
    0 otherwise."""

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens) and int(self.sample_index.numel()) == len(self.rows)

    @property
    def q_starts(self) -> list[int]:
        return [0, *np.cumsum(self.q_lens).tolist()]

    def token_rows_positions(self) -> tuple[list[int], list[int]]:
        """Per-token (table row, position), host side."""
        rows = np.repeat(np.asarray(self.rows, dtype=np.int64), self.q_lens)
        q_lens = np.asarray(self.q_lens, dtype=np.int64)
        pos = concat_ranges(np.asarray(self.kv_lens, dtype=np.int64) - q_lens, q_lens)
        return rows.tolist(), pos.tolist()
