"""`eval/accuracy` counts eval problems (prompts), also when a generate plugin returns several samples for
one prompt (rollout.generate_fn, rollout/multiturn.py)."""

from __future__ import annotations

from miles.evaluate import evaluate
from miles.rollout import Engine, SamplingParams
from miles.rollout.multiturn.rollout import EngineClient, MultiTurnRollout, Trajectory
from miles.sample import Sample
from tests.support.models import rollout_config, tiny_model

VERDICTS = {5: [0.0, 1.0], 6: [1.0, 0.0], 7: [1.0]}
"""Per prompt (by its first token), the reward of each sample the plugin returns for it, in order: prompt 5's
trajectory ends right after a wrong first turn, prompt 6's ends wrong, prompt 7 is one turn, right."""


class VerdictRewards:
    """Scores each sample with the verdict its plugin wrote into its metadata."""

    def score(self, samples: list[Sample]) -> dict[str, float]:
        for s in samples:
            s.reward = s.metadata["verdict"]
        return {"reward/mean": sum(s.reward for s in samples) / len(samples)}


async def one_sample_per_turn(client: EngineClient, sample: Sample, params: SamplingParams) -> list[Sample]:
    """Returns the trajectory as one sample per model turn (README: "a list of samples (e.g. one per turn)")."""
    traj, out = Trajectory(sample), []
    for verdict in VERDICTS[sample.prompt_ids[0]]:
        traj.add_turn(await client.generate(traj.ids, params.with_(max_new_tokens=3)))
        turn = traj.to_sample()
        turn.metadata["verdict"] = verdict
        out.append(turn)
    return out


def test_accuracy_is_per_prompt_when_a_plugin_returns_several_samples() -> None:
    engine = Engine(tiny_model(False, seed=1), None, rollout_config({"kv_cache_bytes": 4 * 1024 * 1024}, {}))
    rollout = MultiTurnRollout(engine, one_sample_per_turn)
    # As to_samples makes them: every eval prompt has group_id 0.
    prompts = [Sample(prompt_ids=[first, 8, 9, 10]) for first in VERDICTS]
    try:
        metrics, samples = evaluate(rollout.generate, VerdictRewards(), prompts, 3, [], [])
    finally:
        rollout.close()
    assert len(samples) == 5 and metrics["eval/num_samples"] == 5.0
    # Each problem's last sample (its trajectory's end) decides: 5 right, 6 wrong, 7 right.
    assert metrics["eval/accuracy"] == 2 / 3
    assert metrics["eval/count"] == 3.0  # the problems: what a data-parallel run weighs each rank's by


def test_accuracy_of_one_sample_per_prompt_is_unchanged() -> None:
    engine = Engine(tiny_model(False, seed=1), None, rollout_config({"kv_cache_bytes": 4 * 1024 * 1024}, {}))
    prompts = [
        Sample(prompt_ids=[first, 8, 9, 10], metadata={"verdict": v[-1]}) for first, v in VERDICTS.items()
    ]
    metrics, samples = evaluate(engine.generate, VerdictRewards(), prompts, 3, [], [])
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert metrics["eval/accuracy"] == 2 / 3 and metrics["eval/num_samples"] == metrics["eval/count"] == 3.0


def test_data_parallel_ranks_accuracy_is_per_prompt() -> None:
    """The loop combines the ranks' eval metrics weighted by their samples; `eval/count` makes the accuracy's
    weight their prompts: rank 0 got 1 of 2 problems right in 4 samples, rank 1 both in 2."""
    from miles.distributed import combine_metrics

    ranks = [
        {"eval/accuracy": 0.5, "eval/num_samples": 4.0, "eval/count": 2.0},
        {"eval/accuracy": 1.0, "eval/num_samples": 2.0, "eval/count": 2.0},
    ]
    combined = combine_metrics(ranks, [4.0, 2.0])
    assert combined == {"eval/accuracy": 0.75, "eval/num_samples": 6.0, "eval/count": 4.0}
