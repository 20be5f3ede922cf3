"""Bounds on the work a model's math answer may cause before it reaches `Fraction` or sympy.

A few characters can ask for astronomically large numbers: `1e30000000` (a 30-million-digit integer once it is a
`Fraction`), `9^{9^{9}}` (sympy evaluates integer powers eagerly and never returns), `100000!`. That big-int work
runs in C holding the GIL, so no thread-based timeout can stop it (reward.num_workers=0 runs the grader on a helper
thread of the trainer process) and it freezes the training step. `too_costly` spots such answers with regexes and
a tiny parser of numeric exponents, never building the numbers; the grader scores them as not equal.
"""

from __future__ import annotations

import math
import re

MAX_DIGITS = 1000
"""Longest run of digits graded; a longer literal is refused (str -> int is quadratic, and 4300 digits raise)."""
MAX_RESULT_DIGITS = 10_000
"""A numeric power `b^e` (or `b e N` scientific notation) may produce at most this many digits."""
MAX_SYMBOLIC_EXPONENT = 1000
"""Largest numeric exponent on a non-numeric base (`x^{1000}`): sympy expands and compares such powers."""
MAX_FACTORIAL = 1000
"""Largest `n!` graded (sympy evaluates factorials of integers eagerly)."""

_LONG_DIGITS = re.compile(rf"\d{{{MAX_DIGITS + 1},}}")
_SCIENTIFIC = re.compile(r"(?<![A-Za-z\\])(?:\d+\.?\d*|\.\d+)[eE][-+]?(\d+)")
_FACTORIAL = re.compile(r"(\d+)\s*!")
_POWER = re.compile(r"\^|\*\*")
_BASE_NUMBER = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*$")
_NUMERIC_TOKEN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+|\*\*|[-+*/^{}()])")
_EXPONENT_TOKEN = re.compile(r"\s*([-+]?\s*(?:\d+(?:\.\d*)?|\.\d+)|\\[A-Za-z]+|\S)")
MAX_TOWER = 16
"""Powers chained without braces (`9^9^9`) read as one tower; a longer chain is refused outright."""
_TOO_DEEP = 10_000
_HUGE_LOG10 = 1e6
"""Magnitudes past 10**_HUGE_LOG10 are all 'infinite' for the bounds below."""


MAX_EXPONENT_CHARS = 200
"""An exponent group is read at most this far (an unclosed `^{` must not make every power scan the whole text)."""


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _group_end(text: str, start: int) -> int:
    """Index after the `{...}` / `(...)` group opening at text[start]; the window's end when it does not close
    within MAX_EXPONENT_CHARS."""
    opener = text[start]
    closer = "}" if opener == "{" else ")"
    limit = min(len(text), start + MAX_EXPONENT_CHARS)
    depth = 0
    for i in range(start, limit):
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    return limit


def _one_exponent(text: str, pos: int) -> tuple[str, int, bool]:
    """(the exponent at `pos`, the index after it, whether it is complete: a group closed within the window)."""
    pos = _skip_spaces(text, pos)
    if pos < len(text) and text[pos] in "{(":
        end = _group_end(text, pos)
        return text[pos:end], end, text[end - 1] in "})"
    token = _EXPONENT_TOKEN.match(text, pos)
    end = token.end() if token else len(text)
    return text[pos:end], end, True


def _exponent_at(text: str, pos: int) -> tuple[str, int]:
    """The exponent written after a power operator ending at `pos`, and the index after it. A chain (`9^9^9`) is
    read as one right-associative tower, as a parser that accepts it would evaluate it; a chain longer than
    MAX_TOWER is returned as an unreadably deep one (never a real answer, and reading it all per operator would
    make long chains quadratic)."""
    parts = []
    while True:
        part, end, complete = _one_exponent(text, pos)
        parts.append(part)
        chained = _POWER.match(text, _skip_spaces(text, end)) if complete else None
        if not chained:
            break
        if len(parts) >= MAX_TOWER:
            return "{" * _TOO_DEEP, end
        pos = chained.end()
    tower = parts[-1]
    for part in reversed(parts[:-1]):
        tower = f"{{{part}}}^{{{tower}}}"
    return tower, end


class _NotNumeric(Exception):
    """The expression holds a variable, a command or something this parser does not read."""


def _size(value: float) -> float:
    """max(|v|, 1/|v|, 2): a bound on how large the value or its reciprocal is (both cost big-int work)."""
    magnitude = abs(value)
    return max(2.0, magnitude, 1.0 / magnitude if magnitude else 0.0)


class _SizeBound:
    """Upper bound on `_size` of a purely numeric expression (numbers, + - * / ^ **, braces, parentheses).
    Sums, products and quotients are bounded by the product of their terms' sizes; a power b^e by size(b)**size(e),
    computed in log space so nothing large is ever built."""

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            match = _NUMERIC_TOKEN.match(text, pos)
            if match is None:
                if text[pos:].strip():
                    raise _NotNumeric(text)
                break
            self.tokens.append(match.group(1))
            pos = match.end()
        self.pos = 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expression(self, closer: str | None = None) -> float:
        log_size = 0.0
        while self._peek() is not None and self._peek() != closer:
            if self._peek() in ("+", "-", "*", "/"):
                self.pos += 1
                continue
            log_size += self._power()
        return log_size

    def _power(self) -> float:
        base = self._atom()
        if self._peek() in ("^", "**"):
            self.pos += 1
            exponent_log = self._power()
            if exponent_log > math.log10(_HUGE_LOG10):
                return math.inf
            return 10**exponent_log * base
        return base

    def _atom(self) -> float:
        token = self._peek()
        if token is None:
            raise _NotNumeric("dangling operator")
        self.pos += 1
        if token in ("{", "("):
            inner = self.expression("}" if token == "{" else ")")
            self.pos += 1  # the closer (or the end of an unclosed group)
            return inner
        if token in ("^", "**", "}", ")"):
            raise _NotNumeric(token)
        return math.log10(_size(float(token)))


def numeric_log_size(text: str) -> float | None:
    """log10 of an upper bound on max(|value|, 1/|value|) of a numeric expression; None when it is not purely
    numeric (a variable, a LaTeX command); inf when it is nested too deeply to read."""
    stripped = text.strip()
    if not stripped:
        return None
    try:
        return _SizeBound(stripped).expression()
    except _NotNumeric:
        return None
    except RecursionError:  # thousands of nested groups or a huge tower: refuse it rather than read it
        return math.inf


def _power_too_costly(text: str, operator: re.Match[str]) -> tuple[bool, int]:
    """(whether this power may build a huge number, the index up to which its powers are judged: the end of a
    numeric exponent, whose inner powers its bound covers; otherwise just past the operator)."""
    exponent, end = _exponent_at(text, operator.end())
    exponent_log = numeric_log_size(exponent)
    if exponent_log is None:  # symbolic (`e^{x^2}`): each numeric power inside it is judged on its own
        return False, operator.end()
    if exponent_log > math.log10(_HUGE_LOG10):
        return True, end
    exponent_size = 10**exponent_log
    base = _BASE_NUMBER.search(text, 0, operator.start())
    if base is None:
        return exponent_size > MAX_SYMBOLIC_EXPONENT, end
    return exponent_size * math.log10(_size(float(base.group(1)))) > MAX_RESULT_DIGITS, end


def too_costly(text: str) -> str | None:
    """Why grading `text` could do unbounded big-number work (a huge literal, exponent or factorial, or a power
    tower), or None when it is safe to hand to Fraction / sympy."""
    if _LONG_DIGITS.search(text):
        return f"a number with more than {MAX_DIGITS} digits"
    for match in _SCIENTIFIC.finditer(text):
        if len(match.group(1)) > 6 or int(match.group(1)) > MAX_RESULT_DIGITS:
            return f"a decimal exponent above {MAX_RESULT_DIGITS}"
    for match in _FACTORIAL.finditer(text):
        if int(match.group(1)) > MAX_FACTORIAL:
            return f"a factorial of more than {MAX_FACTORIAL}"
    judged_until = 0
    for operator in _POWER.finditer(text):
        if operator.start() < judged_until:
            continue
        costly, judged_until = _power_too_costly(text, operator)
        if costly:
            return "a power with a huge numeric exponent (or a tower of powers)"
    return None
