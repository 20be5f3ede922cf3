"""An engine in its own process (miles/placement/engine_process.py): it generates what an engine in this
process generates on the same weights, before and after a sync, and its samples carry the weight version
they were generated with, requests in flight during a sync included."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.placement.engine_process import EngineProcess, EngineProcessError
from miles.rollout import SamplingParams
from miles.sample import Sample
from miles.weight_sync import TransportWeightSync, make_sender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import TIMEOUT_S, tiny_engine

PROMPTS = [[3, 14, 15, 92, 65, 35], [2, 71, 82], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SEEDED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=1234)


def drawn(samples: list[Sample]) -> list[tuple]:
    return [(s.group_id, s.index, s.response_ids, s.rollout_logprobs, s.status) for s in samples]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_generate_sync_generate_matches_an_engine_in_this_process(
    moe: bool, engine_process: Callable[..., EngineProcess]
) -> None:
    engine = engine_process(moe)
    version = engine.weight_version
    here = tiny_engine(moe, seed=0)  # the engine process started from the same (seed 0) weights
    here.update_weights([], version)
    for params in (GREEDY, SEEDED):
        assert drawn(engine.generate(PROMPTS, params)) == drawn(here.generate(PROMPTS, params))

    trainer = tiny_model(moe, seed=5)
    sender = make_sender("shm", [engine.sync_channel], 8 / 1024, TIMEOUT_S)
    sender.connect()
    try:
        result = TransportWeightSync(trainer, sender).sync(version + 1)
    finally:
        sender.close()
    assert result.checksum_ok

    here_new = tiny_engine(moe, seed=5)
    here_new.update_weights([], version + 1)
    for params in (GREEDY, SEEDED):
        remote = engine.generate(PROMPTS, params)
        assert drawn(remote) == drawn(here_new.generate(PROMPTS, params))
        assert {s.weight_version for s in remote} == {version + 1}
    assert engine.metrics()["rollout/weight_version"] == version + 1


@pytest.mark.parametrize("policy", ["retract", "finish"])
def test_requests_in_flight_during_a_sync_follow_the_update_policy(
    policy: str, engine_process: Callable[..., EngineProcess]
) -> None:
    """Submitted, then a sync before the answer: each sample is what an engine on the weights of the version
    it carries generates (retract: the new weights, as the sync arrives between the engine's steps; finish:
    the old ones)."""
    engine = engine_process(False, update_policy=policy)
    old_version = engine.weight_version
    new_version = old_version + 1
    long = SamplingParams(n=2, temperature=0.0, max_new_tokens=64, ignore_eos=True)
    on = {
        old_version: drawn(tiny_engine(seed=0).generate(PROMPTS, long)),
        new_version: drawn(tiny_engine(seed=6).generate(PROMPTS, long)),
    }
    sender = make_sender("shm", [engine.sync_channel], 8 / 1024, TIMEOUT_S)
    sender.connect()
    try:
        request = engine.submit(PROMPTS, long)
        result = TransportWeightSync(tiny_model(seed=6), sender).sync(new_version)
    finally:
        sender.close()
    assert result.checksum_ok
    samples = engine.result(request, TIMEOUT_S)
    versions = {s.weight_version for s in samples}
    assert len(versions) == 1, "one generate call's requests are in flight together"
    (version,) = versions
    # retract: in flight when the sync arrived, restarted on the new weights; finish: done on the old ones
    assert version == (new_version if policy == "retract" else old_version)
    assert drawn(samples) == on[version]


def test_errors_come_back_named(engine_process: Callable[..., EngineProcess]) -> None:
    engine = engine_process(False)
    with pytest.raises(EngineProcessError, match="text prompts need a tokenizer"):
        engine.generate(["no tokenizer here"], GREEDY)
    with pytest.raises(EngineProcessError, match="unknown engine call"):
        engine.call("shutdown_everything")
    assert engine.generate(PROMPTS[:1], GREEDY)[0].response_ids  # still serving
