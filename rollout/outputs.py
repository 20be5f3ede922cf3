"""A request's end: when it is finished (EOS, stop ids or strings, length) and the `Sample` it becomes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.models.tokenizer import special_tokens
from miles.rollout.request import Request
from miles.sample import Sample, SampleStatus

if TYPE_CHECKING:
    import torch


def finish_status(req: Request, eos_ids: set[int], max_context: int, tokenizer: Any) -> SampleStatus | None:
    """Status after the request's newest token, or None while it goes on."""
    p = req.params
    token = req.output_ids[-1]
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return SampleStatus.COMPLETED
    if p.stop and hit_stop_string(req, tokenizer):
        return SampleStatus.COMPLETED
    if req.remaining_tokens <= 0 or req.seq_len >= max_context:
        return SampleStatus.TRUNCATED
    return None


def hit_stop_string(req: Request, tokenizer: Any) -> bool:
    """Whether the text now contains a stop string; if so `req.stop_text` is the text before the first.

    Stop strings are matched in the text with special tokens kept (as SGLang's check decodes it), so one that is
    a special token's text ("<|im_end|>", a "</think>" marked special) stops when that token is generated; and,
    where special tokens were generated, also in the text users get (special tokens left out), where a stop
    string may span one. The text before the stop string leaves special tokens out, as every response text does.
    """
    # The look-back is counted in tokens, so it is sized by the stop strings' UTF-8 bytes, not characters: a
    # token holds at least a byte (byte-level BPE splits a rare character into one token per byte; a special
    # token more), and the margin covers a stop string that starts inside a token.
    stops = req.params.stop
    window = max(len(s.encode()) for s in stops) + 8
    tail_ids = req.output_ids[-window:]
    texts: list[str] = []
    tail = tokenizer.decode(tail_ids, skip_special_tokens=False)
    cuts = [i for i in (tail.find(s) for s in stops) if i >= 0]
    if cuts:
        texts.append(_text_before(req.output_ids, tail_ids, tail, min(cuts), tokenizer))
    # Without special tokens in the tail both texts are the same: one decode a step, as before.
    special = not special_tokens(tokenizer).keys().isdisjoint(tail_ids)
    if special and any(s in tokenizer.decode(tail_ids, skip_special_tokens=True) for s in stops):
        text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            texts.append(text[: min(cuts)])
    if not texts:
        return False
    req.stop_text = min(texts, key=len)  # both matched: the earlier stop string
    return True


def _text_before(ids: list[int], tail_ids: list[int], tail: str, cut: int, tokenizer: Any) -> str:
    """The response text before character `cut` of `tail` (the text of `tail_ids`, the last of `ids`, with
    special tokens kept), with special tokens left out."""
    # Decoding `ids` with special tokens skipped keeps the tokenizer's own joining (spaces, bytes split over
    # tokens), which no edit of the text with special tokens kept could (it cannot tell a special token from
    # its text spelled in ordinary tokens): find the tail's tokens wholly before the cut (by bisection: the
    # decoded prefixes only grow).
    lo, hi = 0, len(tail_ids)  # the most tokens whose text ends at or before the cut: in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(tail_ids[:mid], skip_special_tokens=False)) <= cut:
            lo = mid
        else:
            hi = mid - 1
    text = tokenizer.decode(ids[: len(ids) - len(tail_ids) + lo], skip_special_tokens=True)
    # The stop string starts inside the next token's text: its part before the cut, unless it is a special
    # token's (left out).
    if lo < len(tail_ids) and tail_ids[lo] not in special_tokens(tokenizer):
        text += tail[len(tokenizer.decode(tail_ids[:lo], skip_special_tokens=False)) : cut]
    return text


def to_sample(
    req: Request,
    tokenizer: Any,
    weight_version: int,
    prompt_text: str,
    routed: torch.Tensor | None,
) -> Sample:
    src = req.source
    text = req.stop_text
    if text is None:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=True) if tokenizer else ""
    metadata = dict(src.metadata) if src is not None else {}
    if req.error is not None:
        metadata["error"] = req.error
    prompt: Any = src.prompt if src is not None else prompt_text
    return Sample(
        prompt=prompt,
        prompt_ids=list(req.prompt_ids),
        response_ids=list(req.output_ids),
        response_text=text,
        rollout_logprobs=list(req.logprobs),
        loss_mask=[1] * len(req.output_ids),
        group_id=req.group_id,
        index=req.index,
        label=src.label if src is not None else None,
        metadata=metadata,
        status=req.status,
        weight_version=weight_version,
        routed_experts=routed,
        top_logprobs=(
            [req.alternatives.get(i, []) for i in range(len(req.output_ids))]
            if req.params.top_logprobs
            else None
        ),
        spec_stats=(
            {
                "verify_steps": req.spec_steps,
                "draft_tokens": req.spec_draft_tokens,
                "proposed_tokens": req.spec_proposed_tokens,
                "accepted_tokens": req.spec_accepted_tokens,
            }
            if req.spec_steps
            else {}
        ),
    )
