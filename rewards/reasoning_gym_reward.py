"""Score answers to reasoning-gym tasks (`data.source=reasoning_gym:<task>`) with the task's own verifier."""

from __future__ import annotations

import re
from typing import Any

from miles.sample import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final(text: str, numeric: bool = False) -> str:
    """The text inside the last <answer>...</answer>, else after the last `####`, else the last line; for a
    numeric answer, the last number of that last line ("So 4 + 3 - 2 = 5." gives "5", as GSM8K graders do)."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    numbers = _NUMBER.findall(last) if numeric else []
    return numbers[-1] if numbers else last


def _is_number(answer: str) -> bool:
    return _NUMBER.fullmatch(answer.strip()) is not None


def reasoning_gym_reward(sample: Sample, **_: Any) -> dict[str, Any]:
    import reasoning_gym

    source = sample.metadata.get("data_source", "")
    if not source.startswith("reasoning_gym:"):
        raise ValueError(f"sample data_source {source!r} is not a reasoning_gym task")
    task = source.split(":", 1)[1]
    entry = {
        "question": sample.prompt if isinstance(sample.prompt, str) else "",
        "answer": sample.label,
        "metadata": sample.metadata.get("rg_metadata", {}),
    }
    answer = extract_final(sample.response_text, numeric=_is_number(str(sample.label)))
    score = reasoning_gym.get_score_answer_fn(task)(answer, entry)
    return {"score": float(score), "extracted": answer}


class ReasoningGymReward:
    """`reward.fn=reasoning_gym` as a worker builds it: reasoning-gym and what it imports (seconds on a busy
    machine) load when the worker builds the reward, under the pool's bind timeout, rather than inside the
    first sample's `reward.timeout_s`, where a slow import would score that sample 0 as a timeout."""

    def __init__(self, **_: Any) -> None:
        import reasoning_gym  # noqa: F401

    def __call__(self, sample: Sample) -> dict[str, Any]:
        return reasoning_gym_reward(sample)
