"""`trainer.backend=deepspeed` on CPU over gloo, 2 ranks, a tiny dense model: ZeRO-2 and ZeRO-3 apply the
torch backend's updates (losses and weights over 3 steps), the gathered weights reach an engine model with
matching checksums, and a resume from DeepSpeed's sharded checkpoint repeats the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from miles.config import TrainerConfig
from miles.distributed import DataParallel
from miles.errors import MilesUserError
from miles.trainer.deepspeed.config import check_deepspeed_settings, deepspeed_config
from tests.support.deepspeed import offload_worker, zero_worker

pytest.importorskip("deepspeed")

UNTIMED = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/lr", "train/kl")


@pytest.mark.parametrize(
    "stage,tied,moe",
    [(2, False, False), (3, True, False), (3, False, True)],
    ids=["zero2", "zero3_tied", "zero3_moe"],
)
def test_zero_update_equals_the_torch_backend(stage: int, tied: bool, moe: bool, tmp_path: Path) -> None:
    case = {"stage": stage, "tied": tied, "moe": moe}
    mp.start_processes(
        zero_worker, args=(2, str(tmp_path / "store"), case, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    report = json.loads((tmp_path / "report.json").read_text())
    for want, got in zip(report["torch"], report["zero"], strict=True):
        for key in UNTIMED:
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    weights = load_file(str(tmp_path / "weights.safetensors"))
    names = [k[len("torch.") :] for k in weights if k.startswith("torch.")]
    assert names and all(f"zero.{n}" in weights for n in names)
    for name in names:
        torch.testing.assert_close(weights[f"zero.{name}"], weights[f"torch.{name}"], atol=1e-4, rtol=1e-5)
        # the engine holds exactly the gathered weights, and the sync's checksums said so
        assert torch.equal(weights[f"engine.{name}"], weights[f"zero.{name}"]), name
    assert report["checksum_ok"] and report["mismatched"] == [] and report["sync_bytes"] > 0
    # the resume after update 1 repeats updates 2 and 3 bit for bit
    assert report["resumed"] == report["zero"][1:] or _same_untimed(report["resumed"], report["zero"][1:])
    for name in names:
        assert torch.equal(weights[f"resumed.{name}"], weights[f"zero.{name}"]), name


def test_bf16_zero3_with_host_offload_keeps_the_torch_backends_float32_masters(tmp_path: Path) -> None:
    # the torch AdamW steps on the offloaded float32 shards (no DeepSpeed CPU-Adam build)
    mp.start_processes(offload_worker, args=(str(tmp_path),), nprocs=1, start_method="spawn")
    report = json.loads((tmp_path / "report.json").read_text())
    for want, got in zip(report["torch"], report["zero"], strict=True):
        for key in UNTIMED:
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    weights = load_file(str(tmp_path / "weights.safetensors"))
    for name in [k[len("torch.") :] for k in weights if k.startswith("torch.")]:
        assert weights[f"zero.{name}"].dtype == torch.bfloat16
        torch.testing.assert_close(weights[f"zero.{name}"], weights[f"torch.{name}"], atol=1e-4, rtol=1e-5)


def _same_untimed(a: list[dict], b: list[dict]) -> bool:
    return all(x[k] == y[k] for x, y in zip(a, b, strict=True) for k in UNTIMED if k in x)


def test_the_deepspeed_config_comes_from_the_trainer_settings() -> None:
    cfg = TrainerConfig(backend="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    cfg.deepspeed_extra = {"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.5}
    config = deepspeed_config(cfg, bf16_weights=True, world_size=4)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu" and zero["reduce_bucket_size"] == 1000
    assert zero["contiguous_gradients"]  # kept: the extra keys merge into the nested dict
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"]
    assert config["data_types"]["grad_accum_dtype"] == "fp32"
    assert config["zero_force_ds_cpu_optimizer"] is False  # the torch AdamW runs on the offloaded shards


@pytest.mark.parametrize(
    "settings,says",
    [
        ({"zero_stage": 4}, "trainer.zero_stage=4"),
        ({"offload_optimizer": "nvme"}, "trainer.offload_optimizer='nvme'"),
        ({"offload_param": "cpu", "zero_stage": 2}, "needs trainer.zero_stage=3"),
        ({"master_weights": False}, "master_weights=false"),
    ],
)
def test_bad_deepspeed_settings_are_refused_at_start(settings: dict, says: str) -> None:
    with pytest.raises(MilesUserError, match=says.replace("[", r"\[")):
        check_deepspeed_settings(TrainerConfig(backend="deepspeed", **settings))


def test_a_deepspeed_checkpoint_does_not_resume_into_another_backend() -> None:
    from tests.support.deepspeed import trainer_for
    from tests.support.tp import tiny_dense

    trainer = trainer_for(tiny_dense(tied=False), {"backend": "torch"}, DataParallel())
    meta = {"optimizer": "deepspeed", "optimizer_steps_done": 1, "total_optimizer_steps": 3}
    with pytest.raises(MilesUserError, match="resume it with the backend that wrote it"):
        trainer.load_state_dict({"tensors": {}, "meta": meta})
