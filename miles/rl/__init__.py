"""The RL loop: collect (rollout + rewards) → train → sync → eval / save → log, over the parts built once."""

from miles.rl.loop import run_rl

__all__ = ["run_rl"]
