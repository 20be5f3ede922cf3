"""The embedded rollout engine: paged KV cache, radix prefix cache, continuous batching, exact logprobs."""

from miles.rollout.engine import Engine, EngineStats
from miles.rollout.params import SamplingParams

__all__ = ["Engine", "EngineStats", "SamplingParams"]
