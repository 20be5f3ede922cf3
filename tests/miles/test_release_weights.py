"""rollout.release_weights_during_train in the RL loop: refused at start where there is no engine copy of
its own to release (each message names the key and what to set), the release and resume around the update,
and on the GPU a megatron run whose every sync writes the weights back, checksums holding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config import MilesConfig
from miles.config.validate import validate
from miles.config.weights_release import check_weights_release
from miles.distributed import SINGLE
from miles.errors import MilesUserError
from miles.rl.rollout_side import RolloutSide

KEY = "rollout.release_weights_during_train"


def _config(**trainer: Any) -> MilesConfig:
    cfg = MilesConfig()
    cfg.rollout.release_weights_during_train = True
    cfg.trainer.backend = "megatron"
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def _on_a_gpu(monkeypatch: pytest.MonkeyPatch, driver_maps: bool) -> None:
    """The config's device a CUDA device whose driver does (or does not) map reserved addresses."""
    import miles.model_io
    from miles.rollout.kv import virtual_memory

    monkeypatch.setattr(miles.model_io, "pick_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(virtual_memory, "supported", lambda device: driver_maps)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"trainer.backend": "torch"},
            "there is no copy to release; use trainer.backend=megatron or deepspeed",
        ),
        ({"trainer.backend": "torch", "trainer.distributed_optimizer": True}, "with or without"),
        ({"placement.mode": "ray"}, "engines are actors of their own"),
        ({"placement.engine_process": True}, "placement.engine_process=false"),
        ({"rollout.spec_draft_train": True, "rollout.speculative": "head"}, "draft head trains"),
    ],
)
def test_refused_where_the_engine_has_no_copy_of_its_own(
    change: dict[str, Any], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_a_gpu(monkeypatch, driver_maps=True)
    cfg = _config()
    check_weights_release(cfg)  # megatron on a GPU whose driver maps: taken
    for dotted, value in change.items():
        group, key = dotted.split(".")
        setattr(getattr(cfg, group), key, value)
    with pytest.raises(MilesUserError, match=KEY) as err:
        check_weights_release(cfg)
    assert says in str(err.value) and f"{KEY}=false" in str(err.value)


def test_refused_on_cpu_and_without_virtual_memory_management(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config()
    cfg.model.device = "cpu"
    with pytest.raises(MilesUserError, match=f"frees GPU memory .* set {KEY}=false"):
        validate(cfg)  # the start-up check runs it
    _on_a_gpu(monkeypatch, driver_maps=False)
    cfg.model.device = "cuda"
    with pytest.raises(MilesUserError, match="no virtual memory management"):
        check_weights_release(cfg)
    _on_a_gpu(monkeypatch, driver_maps=True)
    cfg.trainer.backend = "deepspeed"
    check_weights_release(cfg)
    cfg.rollout.release_weights_during_train, cfg.trainer.backend = False, "torch"
    check_weights_release(cfg)  # off: nothing to check


class _Engine:
    """What `released_for_update` calls, recorded in order."""

    device = torch.device("cuda")

    def __init__(self) -> None:
        self.calls: list[str] = []
        for name in ("release_memory", "resume_memory", "release_weights", "resume_weights"):
            setattr(self, name, lambda name=name: self.calls.append(name))

    def generate(self, *args: Any) -> list:
        raise AssertionError("not called here")


def _rollout_side(engine: _Engine, kv: bool, weights: bool) -> RolloutSide:
    cfg = MilesConfig()
    cfg.rollout.release_kv_during_train, cfg.rollout.release_weights_during_train = kv, weights
    return RolloutSide(cfg, engine, rewards=None, stop_token_ids=[0], dp=SINGLE)


def test_the_update_runs_between_the_releases_and_the_resumes() -> None:
    engine = _Engine()
    side, timings = _rollout_side(engine, kv=True, weights=True), {}
    with side.released_for_update(True, timings):
        engine.calls.append("update")
    assert engine.calls == ["release_memory", "release_weights", "update", "resume_weights", "resume_memory"]
    assert set(timings) == {"time/kv_release", "time/weights_release"}
    engine.calls.clear()
    with pytest.raises(ValueError, match="the update failed"):  # the memory comes back all the same
        with side.released_for_update(True, {}):
            raise ValueError("the update failed")
    assert engine.calls == ["release_memory", "release_weights", "resume_weights", "resume_memory"]
    engine.calls.clear()
    with side.released_for_update(False, timings):  # no update this step: nothing released
        pass
    assert engine.calls == []
    only, timings = _rollout_side(engine, kv=False, weights=True), {}
    with only.released_for_update(True, timings):
        pass
    assert engine.calls == ["release_weights", "resume_weights"] and set(timings) == {"time/weights_release"}


@pytest.mark.gpu
def test_grpo_math_on_cuda_with_the_engine_weights_released(tmp_path: Path) -> None:
    """The megatron backend's engine copy released during every update (and the KV pool): each sync writes
    the weights back into the same addresses, the checksums hold and the engine's logprobs stay near the
    trainer's."""
    from miles.tracking import read_records
    from tests.support.cli import run_miles

    pytest.importorskip("megatron.core")
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.backend=megatron",
        "model.dtype=bfloat16",
        "model.device=cuda",
        "rollout.backend=torch",  # flashinfer would JIT-compile kernels for this model's head_dim 16 (minutes)
        f"{KEY}=true",
        "rollout.release_kv_during_train=true",
        "trainer.max_steps=3",
        "trainer.eval_every=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["sync/checksum_ok"] == 1.0
        assert record["mismatch/logprob_abs_diff_mean"] < 0.05, record
        assert record["train/grad_norm"] > 0
        assert record["time/weights_release"] > 0 and "time/kv_release" in record
        assert record["memory/peak_rollout_gb"] > 0 and record["memory/peak_update_gb"] > 0
