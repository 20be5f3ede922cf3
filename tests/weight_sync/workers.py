"""Trainer ranks for tests/weight_sync/test_megatron_stream.py (a module of its own, so spawned processes
import it): a tensor-parallel megatron policy whose rank 0 syncs an engine process."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from miles.trainer.backends import build_policy
from miles.weight_sync import Channel, TransportWeightSync, make_sender
from tests.support.models import tiny_model


def tp_sync_worker(
    rank: int, world: int, store: str, conn: Connection, transport: str, version: int, out_dir: str
) -> None:
    """One of `world` TP ranks of a megatron policy; rank 0 sends, every rank runs the gathering stream."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        policy = build_policy("megatron", tiny_model(seed=7), tensor_parallel=world)
        sender = None
        if rank == 0:
            sender = make_sender(transport, [Channel(conn, "engine-dense", 30.0)], 8 / 1024, 30.0)
            sender.connect()
        sync = TransportWeightSync(policy, sender, transport=transport)
        try:
            result = sync.sync(version)
        finally:
            sync.close()
        shard = {n: list(p.shape) for n, p in policy.named_parameters() if "linear_fc1" in n}
        report = {
            "checksum_ok": result.checksum_ok,
            "bytes": result.bytes,
            "sent": result.sent,
            "shard": shard,
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
