"""The `math` reward: extract the final answer, compare numbers exactly (fast path), else ask math-verify.

Answer extraction, in order: the last `\\boxed{...}` / `\\fbox{...}` (nested braces), the text after the last `####`,
the phrase "answer is X" / "Answer: X". After the phrase the answer is the math span that opens it (`$...$`,
`\\(...\\)`, `\\[...\\]`, `$$...$$`, on any line) or the first line cut at the end of its clause ("12, since ...",
"3. The other ...", "7 (seven)"). Plain numbers (signs, thousands separators in well-formed groups, decimals,
fractions, percent, currency and allow-listed unit words) are compared without sympy: integers exactly, decimals
within a relative 1e-6. Everything else (LaTeX expressions, sets, intervals, equations) goes to math-verify, whose
signal-based timeouts are used only on the main thread (reward workers run graders there); an extracted answer
math-verify cannot parse at all falls back to math-verify reading the whole response. Answers that would make
Fraction or sympy build astronomically large numbers (`1e30000000`, `9^{9^{9}}`: see math_limits.py) are graded
as not equal without being evaluated, so a short answer can never freeze a training step.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction
from typing import Any

from miles.rewards.math_limits import too_costly
from miles.sample import Sample

MATH_VERIFY_TIMEOUT_S = 5
RELATIVE_TOLERANCE = 1e-6

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
_CLAUSE_END = re.compile(
    r"\.(?=\s|$)|;|,\s+(?=[A-Za-z]{2})|\s+\((?=[A-Za-z])"
    r"|\s+(?:since|because|as|which|so|thus|hence|therefore|where|when|given|but)\b",
    re.IGNORECASE,
)
"""Where an "answer is" clause ends: a sentence end, `, since`, ` (seven)`, ` because`; `1, 2` and `3.5` go on."""
_NUMBER_THEN_WORDS = re.compile(
    r"(?P<number>[-+−]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?%?)\s+(?P<words>[A-Za-z]+(?:\s+[A-Za-z]+)*)"
)
_NOT_A_NOUN = frozenset(
    "pi i e or and to plus minus times over divided by squared cubed power root roots factorial percent "
    "hundred hundreds thousand thousands million millions billion billions trillion trillions dozen dozens "
    "half halves third thirds quarter quarters tenth tenths hundredth hundredths thousandth thousandths".split()
)
"""Words after a number that change its value ("5 thousand", "3 pi", "2 over 3"): the number alone is not it."""
_NUMBER_TOKEN = re.compile(r"[-+−]?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+−]?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_THIN_SPACE = "\u2009"
_THIN_SPACES = re.compile(r"\\[,!;: ]|~|[\u2009\u202f]")
"""LaTeX spacing commands, `~` and Unicode thin spaces: read as a thin space, a thousands separator between digit
groups (`5\\,000`), nothing elsewhere."""
_THIN_GROUPS = re.compile(rf"[-+]?\d{{1,3}}(?:{_THIN_SPACE}\d{{3}})+(?:\.\d+)?")
_SPACE_OUTSIDE_NUMBER = re.compile(r"(?<![\d.,])\s+|\s+(?![\d.,])")
_SIMPLE_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*([-+]?\d+)")
_LATEX_FRACTION = re.compile(
    r"([-+]?)\\[dt]?frac\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))"
)
_UNITS = (
    "mm cm km meter meters metre metres centimeter centimeters kilometer kilometers millimeter millimeters "
    "inch inches ft foot feet yd yard yards mi mile miles "
    "mg kg gram grams kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons tonne tonnes "
    "ml liter liters litre litres gallon gallons cup cups "
    "sec secs second seconds min mins minute minutes hr hrs hour hours day days week weeks month months "
    "year years "
    "dollar dollars cent cents euro euros usd "
    "deg degree degrees rad radian radians mph kph "
    "unit units"
).split()
"""Unit words a plain number may carry. Never single letters (`5 x`, `3 i`, `2 m` may be algebra), `pi` or
number words (`5 thousand`, `12 dozen`): those answers go to math-verify."""
_UNIT_WORD = "(?:" + "|".join(sorted(_UNITS, key=len, reverse=True)) + r")\b"
_UNIT_PHRASE = (
    rf"(?:(?:square|sq\.?|cubic|cu\.?)\s+)?{_UNIT_WORD}(?:\s*\^\s*\{{?[23]\}}?|[²³])?"
    rf"(?:\s*(?:/|per)\s*(?:{_UNIT_WORD}|[smh]\b))?\.?"  # km/h, m/s: a single letter only after the slash
)
_UNIT_SUFFIX = re.compile(
    rf"\s*(?:\\(?:text|mbox|mathrm|textrm|rm)\s*\{{\s*{_UNIT_PHRASE}\s*\}}(?:\s*\^\s*\{{?[23]\}}?)?"
    rf"|\^\s*\{{?\\circ\}}?|°|\\%|%|\\\$|(?<![\\A-Za-z]){_UNIT_PHRASE})\s*$",
    re.IGNORECASE,
)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


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


def _closing(text: str, close: str, start: int) -> int | None:
    """Index of the first `close` at or after `start` (an escaped `\\$` does not close `$`)."""
    pos = text.find(close, start)
    while close == "$" and pos > 0 and text[pos - 1] == "\\":
        pos = text.find(close, pos + 1)
    return pos if pos >= 0 else None


def _math_span(rest: str) -> str | None:
    """The inside of the `$...$` / `\\(...\\)` / `\\[...\\]` / `$$...$$` span `rest` opens with (lines allowed)."""
    for opener, close in _MATH_DELIMITERS:
        if rest.startswith(opener):
            end = _closing(rest, close, len(opener))
            return rest[len(opener) : end].strip() if end is not None else None
    return None


def _leading_number(span: str) -> str:
    """'12 apples' -> '12': a number followed only by ordinary words is the number. Words that change the value
    ('5 thousand', '3 pi', '5 x') keep the whole span, for math-verify to judge."""
    match = _NUMBER_THEN_WORDS.fullmatch(span)
    if match is None:
        return span
    words = match.group("words").lower().split()
    if any(len(w) == 1 or w in _NOT_A_NOUN for w in words):
        return span
    return match.group("number")


def _answer_after_phrase(rest: str) -> str | None:
    """The answer written after "answer is" / "Answer:": its opening math span, else the first line up to the end
    of its clause ("12, since 3*4=12." -> "12", "3. The other candidate, 4, fails." -> "3")."""
    rest = rest.lstrip()
    if not rest:
        return None
    span = _math_span(rest)
    if span:
        return span
    line = rest.splitlines()[0]
    cut = _CLAUSE_END.search(line)
    answer = re.sub(r"[.\s]+$", "", line[: cut.start()] if cut else line)
    return _leading_number(answer) if answer else None


def extract_answer(text: str) -> str | None:
    """The final answer a response commits to, or None when it does not mark one."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    for match in reversed(list(_ANSWER_IS.finditer(text))):
        answer = _answer_after_phrase(text[match.end() :])
        if answer:
            return answer
    return None


def last_number(text: str) -> str | None:
    tokens = _NUMBER_TOKEN.findall(text)
    return tokens[-1].rstrip(",") if tokens else None


def _strip_wrappers(answer: str) -> str:
    s = _THIN_SPACES.sub(_THIN_SPACE, answer.strip().replace("−", "-").replace("{,}", ","))
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    for _ in range(3):
        s = s.strip().rstrip(".").strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$")
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        if s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2]
        if s.startswith("{") and s.endswith("}") and _braced(s, 0) == (s[1:-1], len(s)):
            s = s[1:-1]
        s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
        s = re.sub(r"^(?:\\\$|\$)\s*", "", s)  # currency
        s = re.sub(r"^([-+])\s*(?:\\\$|\$)\s*", r"\1", s)
    return s.strip()


def _join_digits(s: str) -> str:
    """Drops separators inside a number only where they are unambiguous: thin spaces between well-formed thousands
    groups (`5\\,000`). Other whitespace between digits stays, so `1 1/2`, `1, 125` and `2 3` are not plain
    numbers (a mixed number, a list, two numbers); whitespace elsewhere (`- 5`, `3 / 4`) is dropped."""
    if _THIN_GROUPS.fullmatch(s):
        return s.replace(_THIN_SPACE, "")
    return _SPACE_OUTSIDE_NUMBER.sub("", s)


def parse_number(answer: str) -> Fraction | None:
    """An exact rational for plain numeric answers ('-1,234.5', '3/4', '\\frac{3}{4}', '45%', '$12', '5 cm'),
    None for anything that needs symbolic treatment (or whose digits or exponent are too large to build)."""
    if too_costly(answer):
        return None
    s = _strip_wrappers(answer)
    for _ in range(2):  # "5\\text{ cm}", "90^\\circ", "12 dollars", "45\\%"
        stripped = _UNIT_SUFFIX.sub("", s).strip()
        if not stripped or stripped == s:
            break
        s = stripped
    s = _join_digits(s)
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
    return bool(re.search(r"\d\.|\.\d|\d[eE][-+]?\d", answer))


def numbers_match(gold: Fraction, pred: Fraction, gold_text: str, pred_text: str) -> bool:
    if gold == pred:
        return True
    if not (_is_decimal(gold_text) or _is_decimal(pred_text)):
        return False  # two exact rationals (integers, fractions) must be equal
    # exact arithmetic: a float tolerance would overflow on 1e400-sized answers
    return abs(pred - gold) <= Fraction(str(RELATIVE_TOLERANCE)) * max(1, abs(gold))


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
    """An extracted answer as math-verify input: display delimiters `\\[ \\]` / `\\( \\)` become `$...$`, bare
    math is wrapped in `$...$`; text already holding math delimiters or a `\\boxed` passes as is."""
    s = answer.strip()
    for opener, close in (("\\[", "\\]"), ("\\(", "\\)")):
        if s.startswith(opener) and s.endswith(close) and len(s) >= len(opener) + len(close):
            s = s[len(opener) : -len(close)].strip()
            break
    return s if _UNESCAPED_DOLLAR.search(s) or "\\boxed" in s else f"${s}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    from math_verify import parse

    return parse(_as_latex(gold), parsing_timeout=_math_verify_timeouts()[0])


def _symbolic_verdict(gold: str, prediction: str, whole_response: bool = False) -> bool | None:
    """math-verify equivalence; None when math-verify finds nothing to compare in `prediction`. Text that would
    make sympy build huge numbers (math_limits.too_costly) is never handed to it: not equal."""
    if too_costly(gold) or too_costly(prediction):
        return False
    from math_verify import parse, verify

    parse_timeout, verify_timeout = _math_verify_timeouts()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    pred_parsed = parse(
        prediction if whole_response else _as_latex(prediction), parsing_timeout=parse_timeout
    )
    if not pred_parsed:
        return None
    if verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout):
        return True
    # Only the raw string came back: math-verify found no math in it, so "not equal" would be a guess.
    return False if any(not isinstance(p, str) for p in pred_parsed) else None


def symbolic_match(gold: str, prediction: str, whole_response: bool = False) -> bool:
    """math-verify equivalence; `whole_response` lets math-verify find the answer in free text itself."""
    return bool(_symbolic_verdict(gold, prediction, whole_response))


def grade_math(response: str, ground_truth: Any) -> float:
    """1.0 when the response's final answer equals the ground truth, else 0.0."""
    if ground_truth is None:
        raise ValueError("the math reward needs a ground truth: the sample's label is None")
    gold = _gold_answer(ground_truth)
    gold_number = parse_number(gold)
    answer = extract_answer(response)
    if answer is not None:
        if too_costly(answer):
            return 0.0  # refused, not evaluated: see math_limits.py
        pred_number = parse_number(answer)
        if gold_number is not None and pred_number is not None:
            return float(numbers_match(gold_number, pred_number, gold, answer))
        verdict = _symbolic_verdict(gold, answer)
        if verdict is not None:
            return float(verdict)
        # math-verify cannot read the extracted answer at all: let it find the answer in the whole response.
        return float(symbolic_match(gold, response, whole_response=True))
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
