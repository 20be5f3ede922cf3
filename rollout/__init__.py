"""The embedded rollout engine: paged KV cache, radix prefix cache, continuous batching, exact logprobs."""

from miles.rollout.engine import Engine, EngineStats
from miles.rollout.multiturn import EngineClient, MultiTurnRollout, Trajectory
from miles.rollout.params import SamplingParams

__all__ = ["Engine", "EngineClient", "EngineStats", "MultiTurnRollout", "SamplingParams", "Trajectory"]
