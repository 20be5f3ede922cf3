"""The megatron backend's converted stream (`iter_engine_weights()`: megatron's layout to the engine's names,
gathered over tensor-parallel ranks one tensor at a time) synced into an engine process: the engine then
holds the policy's weights bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from miles.placement.engine_process import EngineProcess
from miles.trainer.backends import build_policy
from miles.weight_sync import TransportWeightSync, make_sender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import TIMEOUT_S, assert_same_weights, exported
from tests.weight_sync.workers import tp_sync_worker

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_stream_lands_bit_for_bit(
    moe: bool, engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    engine = engine_process(moe)
    source = tiny_model(moe, seed=7)
    policy = build_policy("megatron", tiny_model(moe, seed=7))
    assert policy is not source and not hasattr(policy, "model")  # megatron's own modules and names
    for transport in ("shm", "broadcast"):
        sender = make_sender(transport, [engine.sync_channel], 8 / 1024, TIMEOUT_S)
        sender.connect()
        sync = TransportWeightSync(policy, sender)
        try:
            result = sync.sync(engine.weight_version + 1)
        finally:
            sync.close()
        assert result.checksum_ok, result.mismatched
        # Converted fresh each sync: buckets, also where the sender is in direct mode (shm's default)
        assert result.path == "buckets" and result.buckets > 0 and result.metrics()["sync/direct"] == 0.0
        assert_same_weights(exported(engine, tmp_path), source)


def test_tensor_parallel_ranks_gather_while_rank_0_sends(
    engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    """Two TP ranks (gloo, their own default group) each hold half of every split weight; rank 0 sends the
    gathered stream over a broadcast group of its own with the engine, rank 1 takes part in the gathers."""
    engine = engine_process(False)
    version = engine.weight_version + 1
    mp.start_processes(
        tp_sync_worker,
        args=(2, str(tmp_path / "store"), engine.sync_channel.conn, "broadcast", version, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["checksum_ok"] and reports[0]["sent"] and not reports[1]["sent"]
    assert reports[0]["bytes"] == sum(p.numel() * 4 for p in tiny_model(seed=7).parameters())
    full = tiny_model(seed=7).model.layers[0].mlp.gate_up_proj.weight.shape[0]
    assert all(shape[0] == full // 2 for shape in reports[1]["shard"].values())  # never the whole model
    assert engine.weight_version == version
    assert_same_weights(exported(engine, tmp_path), tiny_model(seed=7))
