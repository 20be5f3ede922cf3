"""What the weight-sync tests share: tiny checkpoints, engine processes (started once per module: a spawn
costs seconds of imports on 2 cores) and an engine's sync target served by a thread of this process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.config import RolloutConfig
from miles.models import CausalLM
from miles.models.checkpoint import save_pretrained
from miles.placement.engine_process import EngineProcess, EngineSpec
from miles.rollout import Engine
from miles.weight_sync import Channel, EngineSyncTarget, SyncError
from tests.support.models import tiny_model

TIMEOUT_S = 30.0


def rollout(**overrides: object) -> RolloutConfig:
    cfg = RolloutConfig(kv_cache_bytes=4 * 1024 * 1024, max_batch_tokens=256, max_running_requests=32)
    cfg.overlap_schedule = "off"
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Path]:
    """The tiny dense or MoE model with seed 0, saved once (the engines start from it)."""
    folder = tmp_path_factory.mktemp("weight_sync_checkpoints")

    def get(moe: bool) -> Path:
        path = folder / ("moe" if moe else "dense")
        if not path.exists():
            save_pretrained(tiny_model(moe, seed=0), path)
        return path

    return get


@pytest.fixture(scope="module")
def engine_process(checkpoint: Callable[[bool], Path]) -> Iterator[Callable[..., EngineProcess]]:
    """`engine_process(moe, **rollout)`: an engine process on the seed-0 checkpoint, one per distinct
    request in the module, closed at its end."""
    started: dict[tuple, EngineProcess] = {}

    def get(moe: bool, **overrides: object) -> EngineProcess:
        key = (moe, tuple(sorted(overrides.items())))
        if key not in started:
            spec = EngineSpec(model_path=str(checkpoint(moe)), rollout=rollout(**overrides))
            started[key] = EngineProcess(
                spec, name=f"engine-{'moe' if moe else 'dense'}", timeout_s=TIMEOUT_S
            )
            started[key].start()
        return started[key]

    yield get
    for process in started.values():
        process.close()


def exported(engine: EngineProcess, folder: Path) -> dict[str, torch.Tensor]:
    path = folder / f"{engine.name}.safetensors"
    engine.export_weights(path)
    return load_file(str(path))


def assert_same_weights(held: dict[str, torch.Tensor], model: CausalLM) -> None:
    own = {name: param.detach() for name, param in model.named_parameters()}
    assert held.keys() == own.keys()
    different = [name for name in own if not torch.equal(held[name], own[name])]
    assert not different, different


class ThreadTarget:
    """An `EngineSyncTarget` on an engine of this process, served by a thread; `channel` is the trainer's
    end. Errors the target raised (after reporting them to the trainer) are kept in `errors`."""

    def __init__(self, engine: Engine | object, name: str = "engine-t", timeout_s: float = TIMEOUT_S) -> None:
        trainer_end, engine_end = Pipe()
        self.channel = Channel(trainer_end, name, timeout_s)
        self.target = EngineSyncTarget(engine, Channel(engine_end, "the trainer", timeout_s), name)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.target.channel.recv("waiting for the trainer", float("inf"))
            except SyncError:
                return  # the trainer's end closed
            try:
                self.target.handle(message)
            except Exception as err:
                self.errors.append(err)

    def close(self) -> None:
        self.channel.close()
        self.thread.join(10)


def tiny_engine(moe: bool = False, seed: int = 0, **overrides: object) -> Engine:
    return Engine(tiny_model(moe, seed=seed), None, rollout(**overrides))


def optimizer_step(model: torch.nn.Module, seed: int) -> None:
    """An AdamW step on random gradients: every parameter updated in place (its storage kept)."""
    g = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=g).to(param.device, param.dtype)
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    model.zero_grad(set_to_none=True)
