"""What the placement tests share: a short `grpo_math` run, the metrics every placement measures the same way
(timings and the sync's own accounting differ by design), and a run's records."""

import json
from pathlib import Path

BATCH, N = 4, 4
TRAIN_PROMPTS = "data.train_size=64"
"""Prompts enough for the few steps of 4 these runs take: tokenising the recipe's 20000 would cost every
process that builds the data ~3 s of CPU."""
SHORT_GRPO = [
    "recipe=grpo_math",
    TRAIN_PROMPTS,
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    "data.test_size=8",
    f"rollout.rollout_batch_size={BATCH}",
    f"rollout.n_samples_per_prompt={N}",
    "trainer.global_batch_size=8",
    "trainer.save_final=false",
]
RESUMABLE_GRPO = [
    "recipe=grpo_math",
    TRAIN_PROMPTS,
    "trainer.max_steps=2",
    "trainer.save_every=1",
    "trainer.eval_every=0",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=8",
    "rollout.deterministic=true",
    "model.device=cpu",
]
"""Two CPU steps with a checkpoint after each, bit for bit repeatable: a resume from step 1 must repeat step 2."""
SAME_ON_EVERY_PLACEMENT = (
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "train/loss",
    "train/pg_loss",
    "train/grad_norm",
    "train/entropy",
    "adv/mean",
    "mismatch/logprob_abs_diff_mean",
    "mismatch/logprob_abs_diff_max",
)


def records(run: Path) -> list[dict]:
    """Every line of the run's metrics.jsonl (a line that does not parse fails the test)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
