"""The `math` reward: extract the final answer, compare numbers exactly (fast path), else ask math-verify.

Answer extraction, in order: the last `\\boxed{...}` / `\\fbox{...}` (nested braces), the text after the last `####`,
the phrase "answer is X" / "Answer: X". Plain numbers (signs, thousands separators, decimals, fractions, percent,
currency and unit words) are compared without sympy: integers exactly, decimals within a relative 1e-6. Everything
else (LaTeX expressions, sets, intervals, equations) goes to math-verify, whose signal-based timeouts are used only
on the main thread (reward workers run graders there).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction
from typing import Any

from miles.sample import Sample

MATH_VERIFY_TIMEOUT_S = 5
RELATIVE_TOLERANCE = 1e-6

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER_TOKEN = re.compile(r"[-+−]?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+−]?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SIMPLE_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*([-+]?\d+)")
_LATEX_FRACTION = re.compile(
    r"([-+]?)\\[dt]?frac\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))"
)
_UNIT_SUFFIX = re.compile(
    r"\s*(?:\\(?:text|mbox|mathrm)\s*\{[^{}]*\}|\^\s*\{?\\circ\}?|°|\\%|%|\\\$|"
    r"(?<![\\\w])[a-zA-Z]+(?:\s+[a-zA-Z]+)?\.?)\s*$"
)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] (nested braces allowed) and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}`; `\\boxed 5` (no braces) is accepted too."""
    found = None
    for match in _BOXED.finditer(text):
        end = match.end()
        if end < len(text) and text[end] == "{":
            group = _braced(text, end)
            if group is not None:
                found = group[0]
        elif match.group(0).endswith(" ") or match.group(0).endswith("\t"):
            token = re.match(r"[^\s$]+", text[end:])
            if token:
                found = token.group(0)
    return found.strip() if found is not None else None


def extract_answer(text: str) -> str | None:
    """The final answer a response commits to, or None when it does not mark one."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        answer = matches[-1].group(1).strip().splitlines()[0].strip()
        return re.sub(r"[.\s]+$", "", answer) or None
    return None


def last_number(text: str) -> str | None:
    tokens = _NUMBER_TOKEN.findall(text)
    return tokens[-1].rstrip(",") if tokens else None


def _strip_wrappers(answer: str) -> str:
    s = (
        answer.strip()
        .replace("−", "-")
        .replace("\\!", "")
        .replace("{,}", ",")
        .replace("\\,", "")
        .replace("\\ ", "")
    )
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    for _ in range(3):
        s = s.strip().rstrip(".").strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$")
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        if s.startswith("{") and s.endswith("}") and _braced(s, 0) == (s[1:-1], len(s)):
            s = s[1:-1]
        s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
        s = re.sub(r"^(?:\\\$|\$)\s*", "", s)  # currency
        s = re.sub(r"^([-+])\s*(?:\\\$|\$)\s*", r"\1", s)
    return s.strip()


def parse_number(answer: str) -> Fraction | None:
    """An exact rational for plain numeric answers ('-1,234.5', '3/4', '\\frac{3}{4}', '45%', '$12', '5 cm'),
    None for anything that needs symbolic treatment."""
    s = _strip_wrappers(answer)
    for _ in range(2):  # "5\\text{ cm}", "90^\\circ", "12 dollars", "45\\%"
        stripped = _UNIT_SUFFIX.sub("", s).strip()
        if not stripped or stripped == s:
            break
        s = stripped
    s = s.replace(" ", "")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _PLAIN_NUMBER.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    match = _SIMPLE_FRACTION.fullmatch(s)
    if match:
        numerator, denominator = int(match.group(1)), int(match.group(2))
        return Fraction(numerator, denominator) if denominator else None
    match = _LATEX_FRACTION.fullmatch(s)
    if match:
        sign = -1 if match.group(1) == "-" else 1
        numerator = int(match.group(2) or match.group(3))
        denominator = int(match.group(4) or match.group(5))
        return sign * Fraction(numerator, denominator) if denominator else None
    return None


def _is_decimal(answer: str) -> bool:
    return "." in answer or "e" in answer.lower()


def numbers_match(gold: Fraction, pred: Fraction, gold_text: str, pred_text: str) -> bool:
    if gold == pred:
        return True
    if not (_is_decimal(gold_text) or _is_decimal(pred_text)):
        return False  # two exact rationals (integers, fractions) must be equal
    return abs(pred - gold) <= RELATIVE_TOLERANCE * max(1, abs(gold))


def _gold_answer(ground_truth: Any) -> str:
    text = str(ground_truth).strip()
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        return extract_answer(text) or text
    return text


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main:
        # Off the main thread math-verify cannot arm its signal timeouts and warns on every call; the
        # runner's own hard timeout covers these calls, so the warning is noise.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    return (MATH_VERIFY_TIMEOUT_S, MATH_VERIFY_TIMEOUT_S) if on_main else (None, None)


def _as_latex(answer: str) -> str:
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    from math_verify import parse

    return parse(_as_latex(gold), parsing_timeout=_math_verify_timeouts()[0])


def symbolic_match(gold: str, prediction: str, whole_response: bool = False) -> bool:
    """math-verify equivalence; `whole_response` lets math-verify find the answer in free text itself."""
    from math_verify import parse, verify

    parse_timeout, verify_timeout = _math_verify_timeouts()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    pred_parsed = parse(
        prediction if whole_response else _as_latex(prediction), parsing_timeout=parse_timeout
    )
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))


def grade_math(response: str, ground_truth: Any) -> float:
    """1.0 when the response's final answer equals the ground truth, else 0.0."""
    if ground_truth is None:
        raise ValueError("the math reward needs a ground truth: the sample's label is None")
    gold = _gold_answer(ground_truth)
    gold_number = parse_number(gold)
    answer = extract_answer(response)
    if answer is not None:
        pred_number = parse_number(answer)
        if gold_number is not None and pred_number is not None:
            return float(numbers_match(gold_number, pred_number, gold, answer))
        return float(symbolic_match(gold, answer))
    # No marked answer: accept a matching last number cheaply, otherwise let math-verify read the whole text.
    tail = last_number(response)
    if gold_number is not None and tail is not None:
        tail_number = parse_number(tail)
        if tail_number is not None and numbers_match(gold_number, tail_number, gold, tail):
            return 1.0
    if not response.strip():
        return 0.0
    return float(symbolic_match(gold, response, whole_response=True))


def math_reward(sample: Sample) -> float:
    """Built-in `math` reward: grade_math(sample.response_text, sample.label)."""
    return grade_math(sample.response_text, sample.label)
