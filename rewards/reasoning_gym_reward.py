"""Score answers to reasoning-gym tasks (`data.source=reasoning_gym:<task>`) with the task's own verifier, and
optionally give part of the reward for the first steps of a chain of additions and subtractions written out
right (`step_credit`)."""

from __future__ import annotations

import re
from typing import Any

from miles.sample import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# "a + b = c" anywhere, overlapping ("7 - 2 = 5 + 5 = 10" holds two), never starting inside a number
_STEP = re.compile(r"(?<!\d)(?=(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*(-?\d+))")


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


Step = tuple[int, str, int, int]


def chain_steps(expression: str) -> list[Step] | None:
    """The steps of a left-to-right chain of + and - over integers ("7 - 2 + 5" gives (7, "-", 2, 5) and
    (5, "+", 5, 10)); None for any other expression (brackets, other operators, decimals)."""
    tokens = expression.split()
    if len(tokens) < 3 or len(tokens) % 2 == 0:
        return None
    try:
        value = int(tokens[0])
        terms = [int(t) for t in tokens[2::2]]
    except ValueError:
        return None
    steps = []
    for op, term in zip(tokens[1::2], terms, strict=True):
        if op not in ("+", "-"):
            return None
        result = value + term if op == "+" else value - term
        steps.append((value, op, term, result))
        value = result
    return steps


def steps_written(response: str, steps: list[Step]) -> int:
    """How many of `steps`, from the first, the response writes out right and in order ("a + b = c")."""
    done = 0
    for match in _STEP.finditer(response):
        a, op, b, c = match.groups()
        if done < len(steps) and (int(a), op, int(b), int(c)) == steps[done]:
            done += 1
    return done


def check_step_credit(step_credit: float) -> float:
    if not 0.0 <= step_credit <= 0.5:
        raise ValueError(
            f"reward.kwargs.step_credit={step_credit}: use 0 (off) to 0.5, below a right answer's 1 and "
            "eval/accuracy's 0.5 threshold"
        )
    return step_credit


def reasoning_gym_reward(sample: Sample, step_credit: float = 0.0) -> dict[str, Any]:
    """The verifier's score; with `step_credit` > 0, a wrong answer to a chain of + and - (`chain_sum`, or
    `basic_arithmetic` without brackets) still earns `step_credit` times the share of the chain's steps it
    wrote out right from the first, so a group none of whose answers is right can still hold a reward spread
    to learn from. The final answer alone decides `eval/accuracy` (a score above 0.5; keep the credit
    below that)."""
    import reasoning_gym

    check_step_credit(step_credit)
    source = sample.metadata.get("data_source", "")
    if not source.startswith("reasoning_gym:"):
        raise ValueError(f"sample data_source {source!r} is not a reasoning_gym task")
    task = source.split(":", 1)[1]
    metadata = sample.metadata.get("rg_metadata", {})
    entry = {
        "question": sample.prompt if isinstance(sample.prompt, str) else "",
        "answer": sample.label,
        "metadata": metadata,
    }
    answer = extract_final(sample.response_text, numeric=_is_number(str(sample.label)))
    score = float(reasoning_gym.get_score_answer_fn(task)(answer, entry))
    info: dict[str, Any] = {"extracted": answer}
    steps = chain_steps(str(metadata.get("expression", ""))) if step_credit > 0 else None
    if steps:
        done = steps_written(sample.response_text, steps)
        info["steps_right"] = done
        if score < 1.0:
            score = max(score, step_credit * done / len(steps))
    return {"score": score, **info}


class ReasoningGymReward:
    """`reward.fn=reasoning_gym` as a worker builds it: reasoning-gym and what it imports (seconds on a busy
    machine) load when the worker builds the reward, under the pool's bind timeout, rather than inside the
    first sample's `reward.timeout_s`, where a slow import would score that sample 0 as a timeout.
    `reward.kwargs.step_credit`: see `reasoning_gym_reward`."""

    def __init__(self, step_credit: float = 0.0) -> None:
        import reasoning_gym  # noqa: F401

        self.step_credit = check_step_credit(step_credit)

    def __call__(self, sample: Sample) -> dict[str, Any]:
        return reasoning_gym_reward(sample, self.step_credit)
