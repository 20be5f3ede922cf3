"""Every reward plugin form (sync, async, batched, dict, class, file path, dotted path, verl), weighted
multi-rewards, routing by data_source, kwargs, config errors, and the text built-ins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config import RewardConfig
from miles.rewards import RewardConfigError, RewardRunner, exact_match, format_reward
from miles.sample import Sample

DATA = Path(__file__).parent / "data"
USER = str(DATA / "user_rewards.py")


def samples_of(*responses: str, label: str = "42", **metadata: object) -> list[Sample]:
    return [Sample(response_text=r, label=label, metadata=dict(metadata)) for r in responses]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sync_reward_by_file_path_with_kwargs(num_workers: int) -> None:
    cfg = RewardConfig(fn=f"{USER}:sync_reward", kwargs={"bonus": 0.5}, num_workers=num_workers)
    batch = samples_of("42", "41", "42")
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [1.5, 0.5, 1.5]
    assert metrics["reward/mean"] == pytest.approx(3.5 / 3)
    assert metrics["reward/std"] == pytest.approx((2 / 9) ** 0.5)
    assert metrics["reward/errors"] == 0.0 and metrics["reward/timeouts"] == 0.0


def test_dotted_path_resolves_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(DATA))
    batch = samples_of("42", "x")
    with RewardRunner(RewardConfig(fn="user_rewards:sync_reward", num_workers=2)) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [1.0, 0.0]


def test_async_reward_scores_every_sample() -> None:
    batch = samples_of(*("x" * n for n in range(40)))
    with RewardRunner(RewardConfig(fn=f"{USER}:async_reward", num_workers=2)) as runner:
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [float(n) for n in range(40)]
    assert metrics["reward/errors"] == 0.0


def test_batched_reward_gets_the_whole_list_in_order() -> None:
    batch = samples_of("a", "b", "c", "d")
    with RewardRunner(RewardConfig(fn=f"{USER}:batched_reward", batched=True, num_workers=2)) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [0.0, 1.0, 2.0, 3.0]


def test_dict_return_extra_fields_are_logged() -> None:
    """A dict's extra keys go to reward_info, and the numeric ones' means to the step's metrics."""
    batch = samples_of("hello", "hi")
    with RewardRunner(RewardConfig(fn=f"{USER}:dict_reward", num_workers=2)) as runner:
        metrics = runner.score(batch)
    assert batch[0].reward == 0.5
    assert batch[0].reward_info == {"length": 5, "tag": "hel"}
    assert metrics["reward/info/length/mean"] == 3.5 and metrics["reward/info/length/count"] == 2.0
    assert not any(key.startswith("reward/info/tag") for key in metrics)  # (text is not averaged)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_verl_compute_score_adapter(num_workers: int) -> None:
    batch = [
        Sample(
            response_text=" 42 ", label="42", metadata={"data_source": "gsm8k", "extra_info": {"bonus": 0.5}}
        ),
        Sample(response_text="41", label="42", metadata={"data_source": "other"}),
    ]
    with RewardRunner(RewardConfig(fn=f"{USER}:compute_score", num_workers=num_workers)) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [1.75, 0.0]


def test_verl_batched_adapter_is_detected_from_the_signature() -> None:
    batch = samples_of("42", "7", data_source="math")
    with RewardRunner(RewardConfig(fn=f"{USER}:compute_score_batched", num_workers=0)) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [1.0, 0.0]
    assert batch[0].reward_info == {"source": "math"}


@pytest.mark.parametrize(("num_workers", "in_process"), [(0, False), (2, False), (0, True)])
def test_class_reward_is_built_once_per_process_with_kwargs(num_workers: int, in_process: bool) -> None:
    """User code runs in worker processes, also with num_workers=0 (which keeps only built-ins in the trainer);
    reward.in_process=true is the explicit way to run it in the trainer."""
    cfg = RewardConfig(fn=f"{USER}:ScaledLength", kwargs={"scale": 2.0}, num_workers=num_workers)
    cfg.in_process = in_process
    batch = samples_of("ab", "abcd", "a")
    with RewardRunner(cfg) as r:
        r.score(batch)
    assert [s.reward for s in batch] == [4.0, 8.0, 2.0]
    pids = {s.reward_info["pid"] for s in batch}
    assert (pids == {os.getpid()}) == in_process


def test_weighted_rewards_with_namespaced_kwargs() -> None:
    cfg = RewardConfig(
        weights={"exact_match": 0.3, f"{USER}:dict_reward": 0.7},
        kwargs={"exact_match": {"case_sensitive": True}},
        num_workers=2,
    )
    batch = samples_of("Paris", "paris", label="Paris")
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == pytest.approx([0.3 + 0.35, 0.35])
    assert batch[1].reward_info["exact_match"] == 0.0
    assert batch[1].reward_info["dict_reward"] == 0.5
    assert batch[1].reward_info["dict_reward/length"] == 5
    assert metrics["reward/exact_match/mean"] == 0.5
    assert metrics["reward/dict_reward/mean"] == 0.5
    assert metrics["reward/info/dict_reward/length/mean"] == 5.0
    assert metrics["reward/mean"] == pytest.approx(0.5)


def test_a_failed_component_contributes_zero() -> None:
    cfg = RewardConfig(weights={f"{USER}:selective": 0.5, "exact_match": 0.5}, num_workers=0)
    batch = samples_of("raise", label="raise")
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert batch[0].reward == 0.5
    assert batch[0].reward_info["error"].startswith("selective: ValueError")
    assert metrics["reward/errors"] == 1.0 and metrics["reward/selective/errors"] == 1.0


def test_routing_by_data_source() -> None:
    cfg = RewardConfig(fn="math", by_data_source={"trivia": "exact_match"}, num_workers=0)
    batch = [
        Sample(response_text="#### 12", label="12", metadata={"data_source": "gsm8k"}),
        Sample(response_text="Paris.", label="paris", metadata={"data_source": "trivia"}),
        Sample(response_text="#### 12", label="paris", metadata={"data_source": "trivia"}),
    ]
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [1.0, 1.0, 0.0]
    assert metrics["reward/math/mean"] == 1.0
    assert metrics["reward/exact_match/mean"] == 0.5


def test_hydra_structured_config_is_accepted() -> None:
    cfg = OmegaConf.structured(RewardConfig(fn=f"{USER}:sync_reward", kwargs={"bonus": 1.0}, num_workers=0))
    batch = samples_of("42")
    with RewardRunner(cfg) as runner:
        runner.score(batch)
    assert batch[0].reward == 2.0


@pytest.mark.parametrize(
    ("fn", "kwargs", "message"),
    [
        ("nonexistent", {}, "unknown reward 'nonexistent'"),
        ("/no/such/file.py:f", {}, "does not exist"),
        (f"{USER}:missing", {}, "has no 'missing'"),
        ("no_such_module_xyz:f", {}, "cannot import reward module"),
        (f"{USER}:NOT_CALLABLE", {}, "not a function or class"),
        (f"{USER}:not_a_reward", {}, "must take the sample"),
        (f"{USER}:sync_reward", {"bonsu": 1}, "does not take ['bonsu']"),
        ("format", {"tag": ["x"]}, "does not take ['tag']"),
    ],
)
def test_config_errors_are_clear(fn: str, kwargs: dict, message: str) -> None:
    with pytest.raises(RewardConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RewardRunner(RewardConfig(fn=fn, kwargs=kwargs, num_workers=0))


def test_exact_match_builtin() -> None:
    assert exact_match(Sample(response_text="  The  Answer. ", label="the answer"))["score"] == 1.0
    assert exact_match(Sample(response_text="x", label=["y", "X"]))["score"] == 1.0
    assert exact_match(Sample(response_text="Paris", label="paris"), case_sensitive=True)["score"] == 0.0
    assert exact_match(Sample(response_text="so \\boxed{B}", label="b"), extract=True)["score"] == 1.0


@pytest.mark.parametrize(
    ("response", "kwargs", "score"),
    [
        ("<think>reason</think> 42", {}, 1.0),
        ("<think>reason</think>", {}, 0.0),
        ("<think> </think> 42", {}, 0.0),
        ("42 <think>late</think>", {}, 0.0),
        ("<think>a</think><think>b</think> 4", {}, 0.0),
        ("<think>r</think><answer>4</answer>", {"tags": ["think", "answer"]}, 1.0),
        ("<answer>4</answer><think>r</think>", {"tags": ["think", "answer"]}, 0.0),
        ("Answer: 12", {"pattern": r"Answer: \d+"}, 1.0),
        ("Answer: twelve", {"pattern": r"Answer: \d+"}, 0.0),
    ],
)
def test_format_builtin(response: str, kwargs: dict, score: float) -> None:
    result = format_reward(Sample(response_text=response), **kwargs)
    assert result["score"] == score
    assert bool(result["format_error"]) == (score == 0.0)


def test_a_shared_kwarg_no_reward_takes_is_an_error_with_several_rewards() -> None:
    cfg = RewardConfig(
        weights={"exact_match": 1.0, "format": 0.2}, kwargs={"case_sensitiv": True}, num_workers=0
    )
    with pytest.raises(
        RewardConfigError, match=r"\['case_sensitiv'\] is taken by none of the rewards"
    ) as info:
        RewardRunner(cfg)
    assert "'exact_match' takes ['case_sensitive', 'extract']" in str(info.value)
    misspelt_namespace = RewardConfig(
        weights={"exact_match": 1.0, "format": 0.2},
        kwargs={"exact_mach": {"case_sensitive": True}},
        num_workers=0,
    )
    with pytest.raises(RewardConfigError, match="exact_mach"):
        RewardRunner(misspelt_namespace)
    with pytest.raises(RewardConfigError, match="must be a mapping"):
        RewardRunner(
            RewardConfig(weights={"exact_match": 1.0, "format": 0.2}, kwargs={"format": 1}, num_workers=0)
        )
    shared = RewardConfig(
        weights={"exact_match": 1.0, "format": 0.2}, kwargs={"case_sensitive": True}, num_workers=0
    )
    with RewardRunner(shared) as runner:  # taken by one of them: passed to that one only
        assert runner.functions["exact_match"].kwargs == {"case_sensitive": True}
        assert runner.functions["format"].kwargs == {}
