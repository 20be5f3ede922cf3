"""A stand-in for miles.rollout.Engine in judge tests: `generate(prompts, params) -> list[Sample]` whose reply
depends on the graded response found in the judge prompt."""

from __future__ import annotations

import os

from miles.sample import Sample

REPLIES = {"paris": "The response is correct.\nScore: 9", "london": "I'd say 3/10", "lyon": "Score: 14"}


class FakeJudgeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[int, object]] = []
        self.pid = os.getpid()

    def generate(self, prompts: list[Sample], params: object) -> list[Sample]:
        self.calls.append((len(prompts), params))
        replies = []
        for prompt in prompts:
            graded = prompt.prompt.split("Response to grade:\n", 1)[1].split("\n", 1)[0].strip().lower()
            replies.append(Sample(prompt=prompt.prompt, response_text=REPLIES.get(graded, "no idea")))
        return replies


def make_engine(model_path: str) -> FakeJudgeEngine:
    assert model_path == "fake-judge"
    return FakeJudgeEngine()
