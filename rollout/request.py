"""`Request`: the engine's state for one sample being generated (prompt, output so far, KV bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.rollout.kv.radix_cache import TreeNode
from miles.rollout.sampling.params import SamplingParams
from miles.sample import Sample, SampleStatus


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    group_id: int = 0
    index: int = 0
    source: Sample | None = None
    """The input Sample whose prompt / label / metadata the result copies."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    error: str | None = None
    abort_requested: bool = False
    stop_text: str | None = None
    """Response text cut before a matched stop string."""
    alternatives: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """`params.top_logprobs` > 0: output position -> its most likely tokens and their logprobs."""
    # KV bookkeeping (see kv/manager.py)
    row: int = -1
    """Row of the request table while the request holds KV, else -1."""
    kv_len: int = 0
    """Positions [0, kv_len) have keys and values in the pool."""
    prefix_len: int = 0
    """Positions [0, prefix_len) are slots owned by the radix tree (pinned through `node`)."""
    node: TreeNode | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the radix cache at first admission (for metrics)."""
    admitted: bool = False
    # overlap scheduling (see engine.py)
    inflight_tokens: int = 0
    """Positions computed by the launched, not yet committed step (their KV is being written)."""
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed to follow the sequence, verified by the next step."""
    draft_proposed: int = 0
    """Of `draft`, the leading tokens the n-grams proposed; the rest are filler (verify graphs, GPU)."""
    ngram: Any = None
    """Its n-gram index over prompt + output (spec/ngram.py), built on first use."""
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    end_ids: frozenset[int] | None = None
    """The token ids that end it (EOS unless `ignore_eos`, and `stop_token_ids`), fixed when it is added;
    None (stop strings, or not set) checks every token in full (`outputs.finish_status`)."""
    room: int = 0
    """Output tokens the prompt leaves room for: up to the model's context, or the KV pool's capacity + 1
    where that is smaller (`Engine.max_seq_len`)."""
    pending_index: int = -1
    """Row of the newest output token in its step's sampled tokens while that token is still on the device
    (`output_ids[-1]` is then the placeholder -1); -1 when every output token is known."""

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building the whole list."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def is_decoding(self) -> bool:
        """All tokens but the newest have KV: the next step feeds one token."""
        return self.row >= 0 and self.kv_len == self.seq_len - 1

    @property
    def can_grow(self) -> bool:
        """Another token may still be generated (a request whose last allowed token is in flight cannot)."""
        return self.params.max_new_tokens > len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status != SampleStatus.PENDING

    @property
    def known_output_ids(self) -> list[int]:
        """The output without the placeholders of tokens still on the device (overlap scheduling)."""
        end = len(self.output_ids)
        while end and self.output_ids[end - 1] < 0:
            end -= 1
        return self.output_ids[:end]

    def restart(self) -> None:
        """Drop the output (a retracted request regenerated on new weights): it starts again from its prompt."""
        self.output_ids, self.logprobs, self.stop_text, self.ngram = [], [], None, None
        self.alternatives = {}
        self.spec_steps = self.spec_draft_tokens = self.spec_proposed_tokens = self.spec_accepted_tokens = 0
