"""The `exact_match` and `format` built-ins."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from miles.rewards.math_grader import extract_answer
from miles.sample import Sample


def _normalize(text: str, case_sensitive: bool) -> str:
    text = unicodedata.normalize("NFKC", text).strip()
    text = re.sub(r"\s+", " ", text).rstrip(".")
    return text if case_sensitive else text.casefold()


def exact_match(sample: Sample, case_sensitive: bool = False, extract: bool = False) -> dict[str, Any]:
    """1.0 when the response equals the label (or any label of a list) after trimming whitespace, collapsing
    inner whitespace and dropping a final period; `extract` compares the response's marked final answer
    (\\boxed{}, ####, "answer is") instead of the whole response."""
    if sample.label is None:
        raise ValueError("exact_match needs a label: the sample's label is None")
    labels = sample.label if isinstance(sample.label, list | tuple) else [sample.label]
    response = sample.response_text
    if extract:
        response = extract_answer(response) or ""
    prediction = _normalize(response, case_sensitive)
    matched = any(prediction == _normalize(str(label), case_sensitive) for label in labels)
    return {"score": float(matched), "prediction": prediction[:200]}


def format_reward(
    sample: Sample,
    pattern: str | None = None,
    tags: list[str] | tuple[str, ...] = ("think",),
    require_answer: bool | None = None,
) -> dict[str, Any]:
    """1.0 when the response has the required shape, with the reason logged when it does not.

    pattern: a regex the whole (stripped) response must match (re.DOTALL). Otherwise `tags`: each
    `<tag>...</tag>` pair appears exactly once, in this order, with non-empty content, and (require_answer;
    by default unless the last tag is `answer`) some text follows the last closing tag. The default checks
    `<think>...</think>` then an answer; tags=["think", "answer"] checks `<think>...</think><answer>...</answer>`."""
    text = sample.response_text.strip()
    if pattern is not None:
        matched = re.fullmatch(pattern, text, re.DOTALL) is not None
        return {"score": float(matched), "format_error": "" if matched else "does not match the pattern"}
    position = 0
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        if text.count(opening) != 1 or text.count(closing) != 1:
            return {"score": 0.0, "format_error": f"needs exactly one {opening}...{closing}"}
        start, end = text.find(opening), text.find(closing)
        if start < position or end < start:
            return {"score": 0.0, "format_error": f"{opening}...{closing} is out of order"}
        if not text[start + len(opening) : end].strip():
            return {"score": 0.0, "format_error": f"{opening}...{closing} is empty"}
        position = end + len(closing)
    if require_answer is None:
        require_answer = not tags or tags[-1] != "answer"
    if require_answer and not text[position:].strip():
        return {"score": 0.0, "format_error": "no answer after the last closing tag"}
    return {"score": 1.0, "format_error": ""}
