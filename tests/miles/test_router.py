"""The Ray placement's router and trainer-rank sharding, without Ray: a prompt's group goes whole to one
engine, the least loaded one unless an engine that served its prefix is close enough."""

from __future__ import annotations

from miles.placement.ray.router import PREFIX_TOKENS, Router
from miles.placement.ray.sides import shard_by_group
from miles.sample import Sample


def _prompt(ids: list[int], group: int = 0) -> Sample:
    return Sample(prompt="", prompt_ids=ids, group_id=group)


def test_prompts_spread_over_the_least_loaded_engines() -> None:
    router = Router(2)
    prompts = [_prompt([i] * 10) for i in range(6)]  # no shared prefix
    out = router.assign(prompts, n=4, max_new_tokens=8)
    assert sorted(p for engine in out for p in engine) == list(range(6))  # each prompt once, whole
    assert [len(engine) for engine in out] == [3, 3]
    metrics = router.metrics()
    assert metrics["router/engine0_groups"] == metrics["router/engine1_groups"] == 3.0
    assert metrics["router/engine0_load_tokens"] == 3 * (10 + 4 * 8)
    assert router.metrics()["router/engine0_groups"] == 0.0  # counted since the last call


def test_a_prompt_goes_back_to_the_engine_that_served_its_prefix_while_close_to_the_least_loaded() -> None:
    router = Router(2)
    shared = list(range(PREFIX_TOKENS))
    first = router.assign([_prompt(shared + [1])], n=2, max_new_tokens=4)
    engine = 0 if first[0] else 1
    # Same leading tokens, another call: the same engine, though both are idle.
    again = router.assign([_prompt(shared + [2]), _prompt([7] * 40)], n=2, max_new_tokens=4)
    assert 0 in again[engine]
    assert router.metrics()["router/affinity_hits"] == 1.0
    # Within one call, prompts sharing a prefix stay together only while the load stays within a prompt.
    many = router.assign([_prompt(shared + [k]) for k in range(8)], n=2, max_new_tokens=4)
    assert sorted(len(e) for e in many) == [4, 4]


def test_trainer_ranks_take_the_groups_the_embedded_ranks_do() -> None:
    samples = [Sample(prompt="", group_id=g, index=i) for g in range(5) for i in range(2)]
    shards = shard_by_group(samples, 2)
    assert [sorted({s.group_id for s in shard}) for shard in shards] == [[0, 2, 4], [1, 3]]
    assert sum(len(shard) for shard in shards) == len(samples)
