"""reasoning-gym as a data source (optional extra) with its own verifier as the reward."""

from __future__ import annotations

import pytest

from miles.config import DataConfig
from miles.data import load_rows
from miles.sample import Sample

pytest.importorskip("reasoning_gym")


def test_reasoning_gym_rows_and_reward() -> None:
    from miles.rewards.reasoning_gym_reward import reasoning_gym_reward

    train, test = load_rows(DataConfig(source="reasoning_gym:basic_arithmetic", train_size=5, test_size=3))
    assert len(train) == 5 and len(test) == 3
    row = train[0]
    assert row.metadata["data_source"] == "reasoning_gym:basic_arithmetic"
    good = Sample(
        prompt=row.prompt,
        label=row.label,
        metadata=row.metadata,
        response_text=f"Let me compute.\n<answer>{row.label}</answer>",
    )
    bad = Sample(prompt=row.prompt, label=row.label, metadata=row.metadata, response_text="#### 123456789")
    assert reasoning_gym_reward(good)["score"] == 1.0
    assert reasoning_gym_reward(bad)["score"] < 1.0
