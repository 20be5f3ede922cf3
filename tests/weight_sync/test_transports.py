"""`shm` and `broadcast` (gloo) buckets between two processes: after a sync the engine process holds the
trainer's weights bit for bit, for a dense and a MoE model (experts as stacked blocks, larger than a bucket,
so they travel in pieces), and the engine's own check agrees. (shm's direct mode: test_direct.py.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from miles.placement.engine_process import EngineProcess
from miles.weight_sync import TransportWeightSync, make_sender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import TIMEOUT_S, assert_same_weights, exported

BUCKET_MB = 8 / 1024
"""8 KiB buckets: dozens per sync, and the embedding and stacked experts (24-64 KiB) go in pieces."""


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_engine_process_holds_the_trainer_weights_bit_for_bit(
    moe: bool, engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    engine = engine_process(moe)
    start = engine.weight_version
    for i, transport in enumerate(["shm", "broadcast"]):
        trainer = tiny_model(moe, seed=10 + i)  # other weights than the engine's (seed 0) and the last sync's
        sender = make_sender(transport, [engine.sync_channel], BUCKET_MB, TIMEOUT_S, direct=False)
        (connected,) = sender.connect()
        assert connected.dtype == "float32" and connected.weight_version == start + i
        sync = TransportWeightSync(trainer, sender)
        try:
            result = sync.sync(version=start + i + 1)
        finally:
            sync.close()
        assert result.checksum_ok and not result.mismatched, result.mismatched
        assert result.transport == transport and result.buckets > 10 and result.path == "buckets"
        assert result.bytes == sum(p.numel() * 4 for p in trainer.parameters())
        assert engine.weight_version == start + i + 1
        assert_same_weights(exported(engine, tmp_path), trainer)
        if moe:  # experts travel as the stacked [E, ...] blocks the engine keeps, not one tensor per expert
            assert "model.layers.0.mlp.experts.gate_up_proj" in result.fingerprints
            assert not [n for n in result.fingerprints if re.search(r"experts\.\d+\.", n)]
        metrics = result.metrics()
        assert metrics["sync/checksum_ok"] == 1.0 and metrics["sync/bytes"] == result.bytes
        assert metrics["sync/transport"] == {"shm": 2.0, "broadcast": 3.0}[transport]
        assert metrics["sync/direct"] == 0.0
        assert metrics["sync/gb_per_s"] > 0 and metrics["sync/seconds"] >= metrics["sync/load_seconds"]


def test_one_connection_serves_many_syncs_and_casts_to_the_engine_dtype(
    engine_process: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    """The pool and its handles are opened once; later syncs reuse them. A bfloat16 trainer's tensors are
    cast to the engine's float32 on the way (the engine's check compares what it holds, as sent)."""
    engine = engine_process(False)
    sender = make_sender("shm", [engine.sync_channel], BUCKET_MB, TIMEOUT_S, direct=False)
    sender.connect()
    pool = list(sender._pool)
    assert len(pool) == 2
    try:
        for step in range(3):
            trainer = tiny_model(seed=20 + step).to(torch.bfloat16)
            version = engine.weight_version + 1
            result = TransportWeightSync(trainer, sender).sync(version)
            assert result.checksum_ok, result.mismatched
            assert result.bytes == sum(p.numel() * 4 for p in trainer.parameters())  # float32 on the wire
            assert all(a is b for a, b in zip(sender._pool, pool))
        assert_same_weights(exported(engine, tmp_path), trainer.to(torch.float32))
    finally:
        sender.close()
