"""A request's end: when it is finished (EOS, stop ids or strings, length) and the `Sample` it becomes."""

from __future__ import annotations

from typing import Any

from miles.rollout.request import Request
from miles.sample import Sample, SampleStatus


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
    """Whether the text now contains a stop string; if so `req.stop_text` is the text before the first."""
    # The look-back is counted in tokens, so it is sized by the stop strings' UTF-8 bytes, not characters: a
    # token holds at least a byte (byte-level BPE splits a rare character into one token per byte), and the
    # margin covers a stop string that starts inside a token.
    window = max(len(s.encode()) for s in req.params.stop) + 8
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
    if not any(s in tail for s in req.params.stop):
        return False
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
    if not cuts:
        return False
    req.stop_text = text[: min(cuts)]
    return True


def to_sample(
    req: Request,
    tokenizer: Any,
    weight_version: int,
    prompt_text: str,
    routed: list[list[list[int]]] | None,
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
