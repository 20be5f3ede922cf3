"""The embedded rollout engine: paged KV cache, radix prefix cache, continuous batching, exact logprobs.

Sub-packages by concern: `kv` (pool, manager, radix cache), `attention` (backends), `sampling` (params,
sampler), `spec` (speculative decoding), `multiturn` (generate plugins, tool calls); the engine's core
(engine, scheduler, request, outputs, model runner, CUDA graphs) at this level.
"""

from miles.rollout.engine import Engine
from miles.rollout.multiturn.rollout import EngineClient, MultiTurnRollout, Trajectory
from miles.rollout.sampling.params import SamplingParams
from miles.rollout.stats import EngineStats

__all__ = ["Engine", "EngineClient", "EngineStats", "MultiTurnRollout", "SamplingParams", "Trajectory"]
