"""A trainer rank as a Ray actor: one replica of the policy and its `PolicyTrainer`, in a torch.distributed
group with the run's other ranks (NCCL on GPUs, gloo on CPU), so gradients are summed as in the embedded
placement's data parallelism. The rank also holds the weight senders to the engines it syncs (its colocated
engine, or every engine from rank 0 when disaggregated) and, on rank 0, writes checkpoints.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from miles.build import build_reference, build_trainer, seed_everything, set_cpu_threads
from miles.config import MilesConfig
from miles.distributed import DataParallel
from miles.model_io import load_model
from miles.placement.ray.cluster import bind_host, use_authkey
from miles.sample import Sample
from miles.weight_sync import TransportWeightSync, make_sender
from miles.weight_sync.channel import Channel
from miles.weight_sync.result import TransportSyncResult

log = logging.getLogger("miles.placement")


class TrainerRank:
    """The actor's body (`remote_class()` makes it a Ray actor)."""

    def __init__(self, rank: int, world_size: int, authkey: bytes) -> None:
        use_authkey(authkey)
        self.rank, self.world_size, self.authkey = rank, world_size, authkey
        self.dp: DataParallel | None = None
        self.trainer: Any = None
        self.tokenizer: Any = None
        self.weight_sync: TransportWeightSync | None = None
        self.sync_engines: list[int] = []
        self.version = 0
        """Updates this rank's policy has taken (the step it finished): the weight version it syncs."""

    def rendezvous(self, host: str) -> tuple[str, int]:
        """Rank 0: the address the ranks' process group meets at (`host`, or this node's address; a free
        port)."""
        host = bind_host(host)
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, cfg: MilesConfig, master: tuple[str, int], timeout_s: float = 1800.0) -> int:
        """Join the ranks' group, load the policy (rank 0's weights on every rank) and build its trainer;
        returns what its first update needs beside a colocated engine's KV pool."""
        on_cuda = cfg.model.device.startswith("cuda") or (
            cfg.model.device == "auto" and torch.cuda.is_available()
        )
        if on_cuda:  # Ray shows this actor its GPU as device 0
            cfg.model.device = "cuda:0"
            torch.cuda.set_device(0)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(
                backend="nccl" if on_cuda else "gloo",
                init_method=f"tcp://{master[0]}:{master[1]}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        self.dp = DataParallel(self.rank, self.world_size, 0, on_cuda)
        seed_everything(cfg.trainer.seed)
        set_cpu_threads(cfg.placement.cpu_threads)
        loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed)
        self.dp.broadcast_module(loaded.model)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.trainer = build_trainer(cfg, loaded.model, self.dp, ref_model=build_reference(cfg, self.dp))
        return int(self.trainer.memory_reserve_bytes())

    def pid(self) -> int:
        return os.getpid()

    # the update ----------------------------------------------------------------------------------
    def train(self, samples: list[Sample], update: bool) -> dict[str, float]:
        """This rank's share of the step's samples (advantages set); every rank steps when `update`."""
        self.version += 1
        return self.trainer.train_step(samples) if update else {}

    # weight sync ---------------------------------------------------------------------------------
    def connect_sync(
        self,
        addresses: dict[int, Any],
        transport: str,
        bucket_mb: float,
        timeout_s: float,
        host: str,
    ) -> None:
        """One sender to the engines at `addresses` (engine -> sync socket), connected: every engine this
        rank syncs, in one broadcast group when the transport is `broadcast`. It replaces the previous one
        (after a restart the survivors reconnect as well)."""
        from multiprocessing.connection import Client

        self.close_sync()
        engines = sorted(addresses)
        channels = [
            Channel(Client(addresses[e], authkey=self.authkey), f"engine-{e}", timeout_s) for e in engines
        ]
        device = next(self.trainer.model.parameters()).device
        options = {"host": bind_host(host)} if transport == "broadcast" else {}
        sender = make_sender(transport, channels, bucket_mb, timeout_s, device=device, **options)
        self.sync_engines, self.weight_sync = engines, TransportWeightSync(self.trainer.model, sender)
        sender.connect()

    def sync(self, version: int | None) -> TransportSyncResult | str:
        """The policy's weights into every engine this rank syncs, verified by each, as `version` (None: the
        updates this rank has taken); the error instead when it failed (an engine may have died: the driver
        restarts it and this rank reconnects)."""
        assert self.weight_sync is not None, "connect_sync first"
        try:
            return self.weight_sync.sync(self.version if version is None else version)
        except Exception as err:
            log.error("the weight sync into engines %s failed: %s", self.sync_engines, err)
            return f"{type(err).__name__}: {err}"

    def close_sync(self) -> None:
        """Disconnect the engines (those still there) and close their channels."""
        sync, self.weight_sync = self.weight_sync, None
        if sync is None:
            return
        try:
            sync.close()
        except Exception as err:  # an engine is gone: nothing left to tell it
            log.info("closing the weight sync to engines %s: %s", self.sync_engines, err)
        assert sync.sender is not None
        for channel in sync.sender.channels:  # the live engines wait for this rank's next connection
            channel.close()

    # checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, run_dir: str, step: int, keep_last: int, write_state: dict[str, Any]) -> str:
        """Rank 0: `checkpoints/step_N/` with the policy, tokenizer and resume state (`write_state`: the
        run state's other parts, from the driver)."""
        from miles.resume import save_checkpoint, write_run_state

        def write(folder: Path) -> None:
            write_run_state(folder, step, trainer_state=self.trainer.state_dict(), **write_state)

        return str(save_checkpoint(self.model, self.tokenizer, Path(run_dir), step, write, keep_last))

    def load_checkpoint(self, folder: str, resize_to: int | None) -> None:
        """Every rank: a checkpoint's weights, optimizer state and RNG (and a re-sized LR schedule)."""
        from miles.models.checkpoint import iter_hf_tensors, load_state_into
        from miles.resume import read_run_state, restore_rng

        state = read_run_state(Path(folder))
        self.version = state.step
        with torch.no_grad():
            load_state_into(self.model, iter_hf_tensors(Path(folder)), folder)
        if self.trainer.model is not self.model:
            self.trainer.model.load_from(self.model)
        self.trainer.load_state_dict(state.trainer)
        if resize_to is not None:
            self.trainer.resize_schedule(resize_to)
        restore_rng(state)

    def shutdown(self) -> None:
        self.close_sync()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def remote_class() -> Any:
    import ray

    return ray.remote(max_restarts=0)(TrainerRank)
