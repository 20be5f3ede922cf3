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


def test_task_config_sets_the_generator_and_bad_settings_are_named() -> None:
    from miles.config import MilesConfig
    from miles.config.validate import validate
    from miles.errors import MilesUserError

    cfg = DataConfig(
        source="reasoning_gym:chain_sum",
        train_size=20,
        test_size=5,
        task_config={"min_terms": 4, "max_terms": 4, "min_digits": 1, "max_digits": 1},
    )
    train, test = load_rows(cfg)
    for row in train + test:  # "State the final answer ...: 4 - 1 + 7 + 2 =": four one-digit terms
        expression = row.prompt.rsplit(":", 1)[1].strip(" =")
        terms = expression.replace("-", "+").split("+")
        assert len(terms) == 4 and all(len(t.strip()) == 1 for t in terms), row.prompt
    cfg.task_config = {"min_term": 4}
    with pytest.raises(MilesUserError, match="task_config"):
        load_rows(cfg)
    config = MilesConfig()
    config.data.task_config = {"min_terms": 4}
    with pytest.raises(MilesUserError, match="data.task_config"):
        validate(config)


def test_a_numeric_answer_is_read_from_the_last_line_when_untagged() -> None:
    from miles.rewards.reasoning_gym_reward import reasoning_gym_reward

    row = load_rows(DataConfig(source="reasoning_gym:chain_sum", train_size=1, test_size=1))[0][0]

    def score(text: str) -> float:
        sample = Sample(prompt=row.prompt, label=row.label, metadata=row.metadata, response_text=text)
        return reasoning_gym_reward(sample)["score"]

    assert score(f"First I add.\nSo the sum is {row.label}.") == 1.0
    assert score(f"The sum is {int(row.label) + 1}.") < 1.0
    assert score(f"{row.label} is wrong\n#### {int(row.label) + 1}") < 1.0  # `####` wins over the last line
    assert score("I cannot say.") < 1.0


def test_the_registered_reward_is_built_in_the_worker_and_scores_there() -> None:
    """`reward.fn=reasoning_gym` builds a class in each worker, so reasoning-gym's import runs under the
    pool's bind timeout instead of the first sample's reward.timeout_s."""
    from miles.config import RewardConfig
    from miles.rewards.loading import BUILTINS, load_target
    from miles.rewards.reasoning_gym_reward import ReasoningGymReward
    from miles.rewards.runner import RewardRunner

    assert load_target(BUILTINS["reasoning_gym"]) is ReasoningGymReward
    row = load_rows(DataConfig(source="reasoning_gym:chain_sum", train_size=1, test_size=1))[0][0]
    samples = [
        Sample(prompt=row.prompt, label=row.label, metadata=row.metadata, response_text=text)
        for text in (f"#### {row.label}", f"#### {int(row.label) + 1}")
    ]
    with RewardRunner(RewardConfig(fn="reasoning_gym", num_workers=1)) as runner:
        metrics = runner.score(samples)
    assert [s.reward for s in samples] == [1.0, 0.0] and metrics["reward/errors"] == 0.0


def test_step_credit_rewards_the_first_steps_of_a_chain_written_right() -> None:
    from miles.rewards.reasoning_gym_reward import ReasoningGymReward, chain_steps, steps_written

    steps = chain_steps("7 - 2 + 5 + 1")
    assert steps == [(7, "-", 2, 5), (5, "+", 5, 10), (10, "+", 1, 11)]
    assert steps_written("7 - 2 = 5\n5 + 5 = 10\n10 + 1 = 11", steps) == 3
    assert steps_written("7 - 2 = 5 + 5 = 10 + 1 = 12", steps) == 2  # one line, the last step wrong
    assert steps_written("5 + 5 = 10\n7 - 2 = 5", steps) == 1  # out of order: only the first counts
    assert steps_written("17 - 2 = 5\n5 + 5 = 10", steps) == 0  # "17" is not "7"
    assert steps_written("4 - 7 = -3\n-3 - 7 = -10", chain_steps("4 - 7 - 7")) == 2
    assert chain_steps("4 - -3 + 2") == [(4, "-", -3, 7), (7, "+", 2, 9)]
    for other in ("(4 - 3) + 2", "4 * 3 + 2", "1.5 + 2", "5", "4 +"):
        assert chain_steps(other) is None

    row = load_rows(
        DataConfig(
            source="reasoning_gym:chain_sum",
            train_size=1,
            test_size=1,
            task_config={"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
        )
    )[0][0]
    first = chain_steps(row.metadata["rg_metadata"]["expression"])[0]
    one_step = f"{first[0]} {first[1]} {first[2]} = {first[3]}\n#### 1000"

    def score(text: str, credit: float) -> dict:
        sample = Sample(prompt=row.prompt, label=row.label, metadata=row.metadata, response_text=text)
        return ReasoningGymReward(step_credit=credit)(sample)

    assert score(one_step, 0.4)["score"] == pytest.approx(0.2) and score(one_step, 0.4)["steps_right"] == 1
    assert score(one_step, 0.0)["score"] == 0.0 and "steps_right" not in score(one_step, 0.0)
    assert score(f"#### {row.label}", 0.4)["score"] == 1.0  # a right answer needs no steps
    with pytest.raises(ValueError, match="step_credit"):
        ReasoningGymReward(step_credit=0.8)  # would pass eval/accuracy's 0.5 threshold


def test_an_unknown_reasoning_gym_reward_kwarg_is_refused() -> None:
    from miles.rewards.loading import RewardConfigError, describe

    assert describe("reasoning_gym", "reasoning_gym", {"step_credit": 0.3}, False).kwargs == {
        "step_credit": 0.3
    }
    with pytest.raises(RewardConfigError, match="step_credit"):
        describe("reasoning_gym", "reasoning_gym", {"step_credit_": 0.3}, False)
    bare = "miles.rewards.reasoning_gym_reward:reasoning_gym_reward"  # the function named as a spec
    assert describe(bare, "rg", {"step_credit": 0.3}, False).kwargs == {"step_credit": 0.3}
    with pytest.raises(RewardConfigError, match="step_credit"):
        describe(bare, "rg", {"step_credit_": 0.3}, False)
    from miles.rewards.reasoning_gym_reward import reasoning_gym_reward

    with pytest.raises(ValueError, match="step_credit"):
        reasoning_gym_reward(Sample(prompt="", label="1", response_text="1"), step_credit=0.8)
