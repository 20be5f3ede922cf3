"""Rewards: the plugin API, built-in graders, a sandbox for code, and a runner no reward can crash.

`RewardRunner(cfg).score(samples)` is what the RL loop calls; the rest is usable on its own (docs/rewards.md).
"""

from miles.rewards.code_reward import code_reward, extract_program
from miles.rewards.judge import JudgeReward
from miles.rewards.loading import BUILTINS, RewardConfigError
from miles.rewards.math_grader import extract_answer, grade_math, math_reward
from miles.rewards.outcome import RewardOutcome
from miles.rewards.remote import RemoteReward
from miles.rewards.runner import RewardRunner
from miles.rewards.sandbox import CaseResult, ProgramCase, SandboxLimits, SandboxRun, run_in_sandbox
from miles.rewards.text_rewards import exact_match, format_reward

__all__ = [
    "BUILTINS",
    "CaseResult",
    "JudgeReward",
    "ProgramCase",
    "RemoteReward",
    "RewardConfigError",
    "RewardOutcome",
    "RewardRunner",
    "SandboxLimits",
    "SandboxRun",
    "code_reward",
    "exact_match",
    "extract_answer",
    "extract_program",
    "format_reward",
    "grade_math",
    "math_reward",
    "run_in_sandbox",
]
