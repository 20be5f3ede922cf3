"""The built-in math grader: answer extraction and equivalence over a table of answer formats."""

from __future__ import annotations

import pytest
from math_verify import parse, verify

from miles.rewards import extract_answer, grade_math, math_reward
from miles.rewards.math_grader import last_boxed, parse_number
from miles.sample import Sample

# (response, ground truth, expected score)
CASES: list[tuple[str, str, float]] = [
    # GSM8K style "#### <answer>"
    ("She has 3+4=7 apples.\n#### 7", "7", 1.0),
    ("#### 7", "8", 0.0),
    ("12-20=-8 #### -8", "-8", 1.0),
    ("#### -8", "8", 0.0),
    ("#### 1,234", "1234", 1.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("#### 1,235", "1234", 0.0),
    ("#### 12.50", "12.5", 1.0),
    ("#### $12", "12", 1.0),
    ("#### \\$12.00", "12", 1.0),
    ("#### 12 dollars", "12", 1.0),
    ("#### 45%", "45", 1.0),
    ("#### +5", "5", 1.0),
    ("#### 0.5", "1/2", 1.0),
    ("#### 10000", "10001", 0.0),
    ("#### 1000000000", "1000000001", 0.0),
    ("#### −3", "-3", 1.0),
    ("steps... #### 42\nThat is all.", "42", 1.0),
    ("#### 42", "The total is 40+2 #### 42", 1.0),
    # \boxed{} with nesting
    ("The answer is $\\boxed{42}$.", "42", 1.0),
    ("$\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("$\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}", 1.0),
    ("$\\boxed{\\dfrac{3}{4}}$", "3/4", 1.0),
    ("$\\boxed{\\frac34}$", "0.75", 1.0),
    ("$\\boxed{\\frac{3}{4}}$", "\\frac{4}{3}", 0.0),
    ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("$\\boxed{{\\frac{1}{{2}}}}$", "1/2", 1.0),
    ("first \\boxed{3} then corrected: \\boxed{5}", "5", 1.0),
    ("first \\boxed{5} then corrected: \\boxed{3}", "5", 0.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{-\\frac{1}{3}}", "-1/3", 1.0),
    ("\\boxed{\\frac{-1}{3}}", "-\\frac{1}{3}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed 7", "7", 1.0),
    ("\\fbox{12}", "12", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{2x+1}", "1+2x", 1.0),
    ("\\boxed{x^2}", "x \\cdot x", 1.0),
    ("\\boxed{2x+2}", "1+2x", 0.0),
    ("\\boxed{(1,2)}", "(1,2)", 1.0),
    ("\\boxed{[1,2)}", "[1,2)", 1.0),
    ("\\boxed{[1,2]}", "(1,2)", 0.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{1.5\\times 10^{3}}", "1500", 1.0),
    ("\\boxed{1500}", "1.5e3", 1.0),
    # "The answer is ..." and free text
    ("So the final answer is 24.", "24", 1.0),
    ("Answer: $\\frac{2}{3}$", "2/3", 1.0),
    ("Answer: 0.666667", "2/3", 1.0),
    ("Answer: 0.67", "2/3", 0.0),
    ("We add them and get 17 marbles in total.", "17", 1.0),
    ("We add them and get 17 marbles, not 18.", "17", 0.0),
    ("I think it is $\\frac{1}{2}$ overall", "0.5", 1.0),
    ("", "3", 0.0),
    ("I don't know.", "3", 0.0),
]


@pytest.mark.parametrize(("response", "gold", "expected"), CASES)
def test_grade_math_table(response: str, gold: str, expected: float) -> None:
    assert grade_math(response, gold) == expected


def test_table_is_large_and_has_wrong_answers() -> None:
    assert len(CASES) >= 50
    assert sum(1 for *_, e in CASES if e == 0.0) >= 12


# Numeric cases where math-verify alone (an independent implementation) must agree with our fast path.
CROSS_CHECK = [
    ("$\\boxed{12.50}$", "12.5"),
    ("$\\boxed{-8}$", "-8"),
    ("$\\boxed{-8}$", "8"),
    ("$\\boxed{0.5}$", "1/2"),
    ("$\\boxed{1,234}$", "1234"),
    ("$\\boxed{10000}$", "10001"),
    ("$\\boxed{\\frac{3}{4}}$", "0.75"),
    ("$\\boxed{7}$", "7.0"),
    ("$\\boxed{-0.25}$", "-1/4"),
    ("$\\boxed{1000001}$", "1000000"),
    ("$\\boxed{0.666667}$", "\\frac{2}{3}"),
    ("$\\boxed{0.67}$", "\\frac{2}{3}"),
]


@pytest.mark.parametrize(("response", "gold"), CROSS_CHECK)
def test_fast_path_agrees_with_math_verify(response: str, gold: str) -> None:
    reference = verify(parse(f"${gold}$"), parse(response))
    assert grade_math(response, gold) == float(reference)


def test_extraction() -> None:
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{a} and \\boxed{b{c}}") == "b{c}"
    assert last_boxed("\\boxed{unclosed") is None
    assert extract_answer("work\n#### 72\nextra") == "72"
    assert extract_answer("The answer is 3.") == "3"
    assert extract_answer("no marked answer 5") is None


def test_parse_number() -> None:
    from fractions import Fraction

    assert parse_number("-1,234.5") == Fraction("-1234.5")
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("-\\dfrac{1}{3}") == Fraction(-1, 3)
    assert parse_number("$12") == 12
    assert parse_number("5 cm") == 5
    assert parse_number("1,2") is None  # a tuple, not a thousands separator
    assert parse_number("2x") is None
    assert parse_number("3/0") is None


def test_math_reward_uses_label() -> None:
    assert math_reward(Sample(response_text="#### 9", label="9")) == 1.0
    assert math_reward(Sample(response_text="#### 9", label=9)) == 1.0
    with pytest.raises(ValueError, match="ground truth"):
        math_reward(Sample(response_text="#### 9", label=None))


# A few characters must never make the grader build astronomically large numbers (C big-int work holding the GIL
# cannot be timed out from a thread): these run in a child process so a regression fails instead of hanging.
HUGE_ANSWERS = [
    "\\boxed{1e30000000}",
    "\\boxed{9^{9^{9}}}",
    "\\boxed{9^9^9}",
    "\\boxed{9**9**9}",
    "\\boxed{10^{-100000000}}",
    "\\boxed{x^{9^{9}}}",
    "\\boxed{100000000!}",
    "The answer is 1e30000000.",
    "so the value is 9^{9^{9}}",  # no marked answer: math-verify would read the whole text
    "#### " + "7" * 5000,
]


def test_huge_numbers_and_power_towers_are_refused_quickly() -> None:
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from miles.rewards.math_grader import grade_math, parse_number\n"
        "cases = json.loads(sys.argv[1])\n"
        "print(json.dumps([grade_math(c, '5') for c in cases] + [parse_number('1e30000000')]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(HUGE_ANSWERS)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [0.0] * len(HUGE_ANSWERS) + [None]


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("\\boxed{2^{10}}", "1024"),
        ("\\boxed{2^{2^{3}}}", "256"),
        ("\\boxed{10^{300}}", "10^{300}"),
        ("\\boxed{e^{x^{2}}}", "e^{x^2}"),
        ("\\boxed{2.5\\times 10^{3}}", "2500"),
        ("\\boxed{5!}", "120"),
    ],
)
def test_ordinary_powers_still_grade(response: str, gold: str) -> None:
    assert grade_math(response, gold) == 1.0


def test_large_decimals_compare_without_overflow() -> None:
    assert grade_math("\\boxed{1.0000000001e400}", "1e400") == 1.0
    assert grade_math("\\boxed{1e400}", "1.5e400") == 0.0


def test_too_costly() -> None:
    from miles.rewards.math_limits import too_costly

    for text in ["9^{9^{9}}", "2^{3}^{4}^{5}^{6}", "10^{20000}", "e^{1000000}", "(x+1)^{5000}", "1" * 1001]:
        assert too_costly(text), text
    for text in ["2^{2^{3}}", "x^2+1", "e^{x^2}", "10^{5000}", "2^{-1}", "\\frac{1}{2}^{3}", "1e300", "5!"]:
        assert too_costly(text) is None, text
    assert too_costly("x^" * 5000 + "x")  # a long chain is refused, and quickly (not quadratic)


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("\\boxed{1 1/2}", "11/2", 0.0),  # a mixed number, not 11/2
        ("\\boxed{1, 125}", "1125", 0.0),  # a list, not a thousands separator
        ("\\boxed{2 3}", "23", 0.0),
        ("\\boxed{12 345}", "12345", 0.0),
        ("\\boxed{5\\,000}", "5000", 1.0),  # LaTeX thin spaces between thousands groups
        ("\\boxed{5\\ 000}", "5000", 1.0),
        ("\\boxed{1~000~000}", "1000000", 1.0),
        ("\\boxed{2\\,3}", "23", 0.0),  # not a well-formed group
        ("\\boxed{ - 5}", "-5", 1.0),
        ("\\boxed{3 / 4}", "0.75", 1.0),
        ("\\boxed{5\\,\\text{cm}}", "5", 1.0),
    ],
)
def test_whitespace_between_digits_is_not_dropped(response: str, gold: str, expected: float) -> None:
    assert grade_math(response, gold) == expected


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("\\boxed{5 x}", "5", 0.0),
        ("\\boxed{3 i}", "3", 0.0),
        ("\\boxed{3 pi}", "3", 0.0),
        ("\\boxed{5 thousand}", "5", 0.0),
        ("\\boxed{12 dozen}", "12", 0.0),
        ("\\boxed{5 million}", "5", 0.0),
        ("\\boxed{5 \\text{ cm}^2}", "5", 1.0),
        ("\\boxed{5 square feet}", "5", 1.0),
        ("\\boxed{60 km/h}", "60", 1.0),
        ("#### 3 hours", "3", 1.0),
        ("\\boxed{\\frac{1}{2}\\text{ hours}}", "1/2", 1.0),
    ],
)
def test_only_unit_words_are_dropped(response: str, gold: str, expected: float) -> None:
    assert grade_math(response, gold) == expected


@pytest.mark.parametrize(
    ("response", "gold", "answer"),
    [
        ("The answer is 12, since 3*4=12.", "12", "12"),
        ("The answer is 3. The other candidate, 4, fails.", "3", "3"),
        ("Answer: 7 (seven)", "7", "7"),
        ("The answer is 5 because 2+3=5.", "5", "5"),
        ("The answer is 12 apples, since each box has 3.", "12", "12"),
        ("The answer is $12$, since 3*4=12.", "12", "12"),
        ("The answer is \\[ \\frac{\\pi}{2} \\]", "\\frac{\\pi}{2}", "\\frac{\\pi}{2}"),
        ("The final answer is:\n\\[\nx^2+1\n\\]", "x^2+1", "x^2+1"),
        ("The answer is:\n$$\\frac{\\pi}{2}$$", "\\frac{\\pi}{2}", "\\frac{\\pi}{2}"),
        ("The answer is \\(x^2+1\\).", "x^2+1", "x^2+1"),
        ("The answer is 1,000 meters.", "1000", "1,000"),
        ("Therefore the answer is $(1, 2)$.", "(1,2)", "(1, 2)"),
        ("The answer is 3.5.", "7/2", "3.5"),
    ],
)
def test_answer_phrase_takes_the_answer_not_the_rest_of_the_line(
    response: str, gold: str, answer: str
) -> None:
    assert extract_answer(response) == answer
    assert grade_math(response, gold) == 1.0
    assert bool(verify(parse(f"${gold}$"), parse(response)))  # math-verify agrees these are correct


def test_answer_phrase_keeps_words_that_change_the_value() -> None:
    assert extract_answer("The answer is \\frac{\\pi}{4}, done") == "\\frac{\\pi}{4}"
    assert extract_answer("The answer is 5 thousand.") == "5 thousand"
    assert grade_math("The answer is 5 thousand.", "5") == 0.0
    assert grade_math("The answer is 3 pi.", "3") == 0.0


def test_unparseable_answer_falls_back_to_the_whole_response() -> None:
    # math-verify finds no math in the extracted "\ldots"; it then reads the whole response.
    response = "Final answer: $\\ldots$\n\nSo $x = \\frac{1}{2}$"
    assert grade_math(response, "\\frac{1}{2}") == 1.0
    assert grade_math(response, "\\frac{1}{3}") == 0.0


def test_parse_number_bounds_and_units() -> None:
    assert parse_number("1e30000000") is None
    assert parse_number("1e300") == 10**300
    assert parse_number("5 thousand") is None
    assert parse_number("3 pi") is None
    assert parse_number("5 x") is None
    assert parse_number("12 dollars") == 12
    assert parse_number("5\\,000") == 5000
    assert parse_number("12 345") is None
    assert parse_number("1 1/2") is None
