"""The `judge` built-in: an LLM grades each response against a rubric and its reply's score becomes the reward.

The judge is an engine (miles.rollout.Engine or anything with `generate(prompts, params) -> list[Sample]`): the
policy's own embedded engine (RewardRunner(cfg, engine=engine), or reward.kwargs.engine in code), or a second
engine built from reward.kwargs.model_path (through `engine_factory`, default Engine.from_path). It runs in the
trainer process, all samples of a batch in one generate call. The score is read from the judge's reply
("Score: 7", "7/10", or a bare number), clipped to [0, max_score] and divided by max_score; a reply without a score
gives 0 and a `judge_parse_error` field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from miles.sample import Sample

DEFAULT_RUBRIC = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Reference answer:\n{label}\n\n"
    "Response to grade:\n{response}\n\n"
    "Rate the response from 0 to {max_score} for correctness against the reference (ignore style). "
    'Reply with one line: "Score: <number>".'
)
_SCORE_LINE = re.compile(r"score\s*(?:is|[:=])?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_OUT_OF = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_BARE = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*\.?\s*")


def parse_judge_score(text: str, max_score: float) -> float | None:
    """The raw score in a judge's reply (before clipping), or None when it gives none."""
    lines = _SCORE_LINE.findall(text)
    if lines:
        return float(lines[-1])
    out_of = _OUT_OF.findall(text)
    if out_of:
        value, scale = (float(x) for x in out_of[-1])
        return value / scale * max_score if scale else None
    bare = _BARE.fullmatch(text)
    return float(bare.group(1)) if bare else None


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt if m.get("role") != "system")


def _engine_from_path(model_path: str, **engine_options: Any) -> Any:
    from miles.config import RolloutConfig
    from miles.rollout import Engine

    dtype = engine_options.pop("dtype", "float32")
    device = engine_options.pop("device", "auto")
    return Engine.from_path(model_path, RolloutConfig(**engine_options), dtype, device)


class JudgeReward:
    def __init__(
        self,
        engine: Any = None,
        model_path: str | None = None,
        engine_factory: str | Callable[..., Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        rubric: str = DEFAULT_RUBRIC,
        max_score: float = 10.0,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        chat_template: bool = True,
    ) -> None:
        if engine is None:
            if model_path is None:
                raise ValueError(
                    "the judge needs an engine: set reward.kwargs.model_path (a second engine) or pass "
                    "RewardRunner(cfg, engine=engine) to judge with the policy's own engine"
                )
            factory = engine_factory or _engine_from_path
            if isinstance(factory, str):
                from miles.rewards.loading import load_target, normalize_spec

                factory = load_target(normalize_spec(factory))
            engine = factory(model_path, **(engine_options or {}))
        if not hasattr(engine, "generate"):
            raise ValueError(
                f"the judge engine must have generate(prompts, params); got {type(engine).__name__}"
            )
        if max_score <= 0:
            raise ValueError(f"max_score must be > 0, got {max_score}")
        if "{response}" not in rubric:
            raise ValueError(
                "the judge rubric must contain {response} (it may also use {prompt}, {label}, {max_score})"
            )
        self.engine = engine
        self.rubric = rubric
        self.max_score = float(max_score)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.chat_template = chat_template

    def render(self, sample: Sample) -> str:
        return self.rubric.format(
            prompt=prompt_text(sample.prompt),
            label=sample.label,
            response=sample.response_text,
            max_score=f"{self.max_score:g}",
        )

    def _judge_prompt(self, sample: Sample) -> Sample:
        """The engine tokenizes: chat messages when its tokenizer has a chat template (and chat_template), else text."""
        text = self.render(sample)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            return Sample(prompt=[{"role": "user", "content": text}])
        return Sample(prompt=text)

    def __call__(self, samples: list[Sample]) -> list[dict[str, Any]]:
        try:
            from miles.rollout import SamplingParams
        except ImportError:  # the package may not re-export it yet
            from miles.rollout.sampling.params import SamplingParams

        params = SamplingParams(n=1, temperature=self.temperature, max_new_tokens=self.max_new_tokens)
        replies = self.engine.generate([self._judge_prompt(s) for s in samples], params)
        if len(replies) != len(samples):
            raise RuntimeError(f"the judge engine returned {len(replies)} replies for {len(samples)} prompts")
        results = []
        for reply in replies:
            text = reply.response_text
            raw = parse_judge_score(text, self.max_score)
            if raw is None:
                results.append({"score": 0.0, "judge_reply": text[:300], "judge_parse_error": True})
                continue
            clipped = min(max(raw, 0.0), self.max_score)
            results.append(
                {"score": clipped / self.max_score, "judge_raw_score": raw, "judge_reply": text[:300]}
            )
        return results
