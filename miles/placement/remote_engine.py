"""The RL loop's engine when it runs in a process of its own (`placement.engine_process=true`): the calls the
rollout side makes of an `Engine`, forwarded to an `EngineProcess`, and the sender that pushes the trainer's
weights into it after every update (`weight_sync.transport`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles.config import MilesConfig
from miles.placement.engine_process import EngineProcess, EngineSpec
from miles.rollout import SamplingParams
from miles.sample import Sample
from miles.weight_sync import TransportWeightSync, make_sender


def engine_transport(cfg: MilesConfig, device: torch.device) -> str:
    """`weight_sync.transport` with `auto` resolved for where the engine runs."""
    transport = cfg.weight_sync.transport
    if transport != "auto":
        return transport
    if not cfg.placement.engine_process:
        return "inprocess"
    return "cuda_ipc" if device.type == "cuda" else "shm"


class RemoteEngine:
    """An engine in another process, behind the methods the loop calls on a local one."""

    def __init__(self, process: EngineProcess) -> None:
        self.process = process
        assert process.info is not None, "start() the engine process first"
        self.device = torch.device(process.info.device)

    def generate(
        self,
        prompts: list[Sample],
        params: SamplingParams,
        on_finish: Callable[[Sample], None] | None = None,
    ) -> list[Sample]:
        return self.process.generate(prompts, params, on_finish)

    def metrics(self) -> dict[str, float]:
        return self.process.metrics(True)

    def flush_cache(self) -> None:
        self.process.call("flush_cache")

    def release_memory(self) -> None:
        self.process.call("release_memory")

    def resume_memory(self) -> None:
        self.process.call("resume_memory")

    def state_dict(self) -> dict[str, Any]:
        return self.process.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.process.call("load_state_dict", state)

    def close(self) -> None:
        self.process.close()


def start_engine_process(
    cfg: MilesConfig, policy: torch.nn.Module, device: torch.device, reserve_bytes: int
) -> tuple[RemoteEngine, TransportWeightSync]:
    """The engine process of `cfg` and the verified sync into it, connected (its buffers and handles opened
    once); the engine is then synced to the policy's current weights (version 0), bit for bit."""
    spec = EngineSpec(
        model_path=cfg.model.path,
        seed=cfg.trainer.seed,
        dtype=cfg.model.dtype,
        device=str(device),
        rollout=cfg.rollout,
        num_threads=cfg.placement.cpu_threads or None,
        reserve_bytes=reserve_bytes,
    )
    process = EngineProcess(spec, name="engine-0", timeout_s=cfg.weight_sync.timeout_s).start()
    try:
        transport = engine_transport(cfg, device)
        sender = make_sender(
            transport,
            [process.sync_channel],
            cfg.weight_sync.bucket_mb,
            cfg.weight_sync.timeout_s,
            device=device,
        )
        sender.connect()
        sync = TransportWeightSync(policy, sender)
        first = sync.sync(version=0)
        if not first.checksum_ok:
            raise RuntimeError(
                f"the engine process did not take the policy's weights: {first.mismatched[:5]}"
            )
    except BaseException:
        process.close()
        raise
    return RemoteEngine(process), sync
