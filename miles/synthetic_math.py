"""A built-in synthetic math set: short arithmetic word problems with integer answers.

Deterministic for a seed; train and test splits are drawn from disjoint seeds and de-duplicated against
each other so held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = [
    "Ann",
    "Ben",
    "Cat",
    "Dan",
    "Eve",
    "Fay",
    "Gus",
    "Hal",
    "Ivy",
    "Jon",
    "Kim",
    "Leo",
    "Max",
    "Ned",
    "Olga",
    "Pam",
    "Ray",
    "Sam",
    "Tia",
    "Uma",
]
ITEMS = [
    "apples",
    "books",
    "coins",
    "pens",
    "cards",
    "shells",
    "eggs",
    "cups",
    "hats",
    "stamps",
    "rocks",
    "toys",
]


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: int
    solution: str
    """A worked answer ending in `#### <answer>` (the SFT target)."""
    mistaken_solution: str
    """The same worked answer with the wrong operation chosen (a plausible human slip), for noisy SFT data."""


def _problem(rng: random.Random, difficulty: str) -> MathProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub"] if difficulty == "easy" else ["add", "sub", "mul", "two_step"])
    if kind == "add":
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        hi, lo = max(a, b), min(a, b)
        return MathProblem(q, a + b, f"{a}+{b}={a + b} #### {a + b}", f"{hi}-{lo}={hi - lo} #### {hi - lo}")
    if kind == "sub":
        a = rng.randint(2, 60)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        return MathProblem(q, a - b, f"{a}-{b}={a - b} #### {a - b}", f"{a}+{b}={a + b} #### {a + b}")
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        q = f"{name} has {a} boxes with {b} {item} in each. How many {item} in all?"
        return MathProblem(q, a * b, f"{a}*{b}={a * b} #### {a * b}", f"{a}+{b}={a + b} #### {a + b}")
    a, b, c = rng.randint(5, 40), rng.randint(1, 30), rng.randint(1, 5)
    c = min(c, a + b - 1)
    q = f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} now?"
    return MathProblem(
        q,
        a + b - c,
        f"{a}+{b}={a + b}, {a + b}-{c}={a + b - c} #### {a + b - c}",
        f"{a}+{b}={a + b}, {a + b}+{c}={a + b + c} #### {a + b + c}",
    )


def generate(
    size: int, seed: int, difficulty: str = "easy", exclude: set[str] | None = None
) -> list[MathProblem]:
    if difficulty not in ("easy", "medium"):
        raise ValueError(f"difficulty must be easy or medium, not {difficulty!r}")
    rng = random.Random(seed)
    seen = set(exclude or ())
    problems: list[MathProblem] = []
    attempts = 0
    while len(problems) < size:
        attempts += 1
        if attempts > 50 * size + 1000:
            break  # the space of distinct problems is exhausted; return what exists
        problem = _problem(rng, difficulty)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        problems.append(problem)
    return problems


def splits(
    train_size: int, test_size: int, seed: int, difficulty: str
) -> tuple[list[MathProblem], list[MathProblem]]:
    test = generate(test_size, seed=seed * 2 + 1, difficulty=difficulty)
    train = generate(train_size, seed=seed * 2, difficulty=difficulty, exclude={p.question for p in test})
    return train, test
