"""How many [rows, vocabulary] buffers the logprob path holds at once, forward and backward.

    python -m miles.bench.vocab_buffers --rows 512 --vocab 151936 --hidden 2048

`chunked_logprobs` (trainer/logprobs.py; both the torch and the megatron backends call it through
`packed_logprobs`) runs one forward and backward of `--rows` bf16 hidden rows against a float32 LM head
under a `TorchDispatchMode` that tracks every live tensor whose last dimension is the vocabulary, once per
storage. Reported: the peak bytes of such tensors alive at once, that peak per row of one chunk, and how
many float32 [chunk rows, vocabulary] copies it amounts to. The peak depends on the chunk's rows, not on
`--rows`: no [rows, vocabulary] float32 tensor is kept for autograd.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from miles.trainer.logprobs import chunk_rows, chunked_logprobs


@dataclass
class VocabPeak:
    peak_bytes: int
    chunk_rows: int
    vocab: int

    @property
    def float32_chunk_copies(self) -> float:
        return self.peak_bytes / (4 * self.chunk_rows * self.vocab)


class _LiveVocabTensors(TorchDispatchMode):
    """Bytes of live storages holding tensors whose last dimension is `vocab`; the peak over the run."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.live: dict[int, tuple[int, int]] = {}  # storage address -> (bytes, live tensors on it)
        self.bytes = self.peak = 0

    def _release(self, ptr: int) -> None:
        size, count = self.live[ptr]
        if count > 1:
            self.live[ptr] = (size, count - 1)
            return
        del self.live[ptr]
        self.bytes -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != self.vocab:
                continue
            ptr = t.untyped_storage().data_ptr()
            size, count = self.live.get(ptr, (t.untyped_storage().nbytes(), 0))
            if count == 0:
                self.bytes += size
                self.peak = max(self.peak, self.bytes)
            self.live[ptr] = (size, count + 1)
            weakref.finalize(t, self._release, ptr)
        return out


def measure(
    rows: int,
    vocab: int,
    hidden: int,
    rows_per_chunk: int | None = None,
    seed: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> VocabPeak:
    """With `with_entropy` the entropy is returned and differentiated too (`entropy_grad`)."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    chunk = rows_per_chunk or chunk_rows(vocab)
    tracker = _LiveVocabTensors(vocab)
    with tracker:
        logprobs, entropy = chunked_logprobs(
            h, w, targets, temperature, with_entropy, with_entropy, rows_per_chunk=chunk
        )
        loss = logprobs.sum() + (entropy.sum() if entropy is not None else 0.0)
        loss.backward()
    return VocabPeak(peak_bytes=tracker.peak, chunk_rows=min(chunk, rows), vocab=vocab)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench.vocab_buffers", description=__doc__)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rows-per-chunk", type=int, default=0, help="0: the CPU default (trainer/logprobs.py)")
    a = p.parse_args(argv)
    r = measure(a.rows, a.vocab, a.hidden, a.rows_per_chunk or None)
    print(
        f"{a.rows} rows x {a.vocab} vocabulary, chunks of {r.chunk_rows} rows: peak {r.peak_bytes / 2**20:.1f} MiB "
        f"of [rows, vocabulary] tensors alive at once = {r.peak_bytes / r.chunk_rows / 1e3:.0f} kB per chunk row "
        f"= {r.float32_chunk_copies:.2f} float32 chunk copies ({r.peak_bytes / a.rows / 1e3:.0f} kB per row over all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
