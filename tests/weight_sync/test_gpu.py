"""cuda_ipc between two processes on one GPU (skipped without CUDA). Buckets: the engine process maps the
trainer's pool of buckets once and holds the trainer's weights bit for bit after each sync. Direct (the
default): the engine maps the trainer's parameters once and copies straight from them, after its stream
waited for the trainer's ready event; bit for bit for a bf16 trainer, checksum-ok for a float32 one (cast
on the way), again after an optimizer step in place and after a parameter was reallocated. And `miles bench
sync` measures the direct path against the copy floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.bench.sync import main as bench_sync
from miles.models.checkpoint import save_pretrained
from miles.placement.engine_process import EngineProcess, EngineSpec
from miles.weight_sync import TransportWeightSync, make_sender
from tests.support.models import tiny_model
from tests.weight_sync.conftest import TIMEOUT_S, assert_same_weights, exported, optimizer_step, rollout

pytestmark = pytest.mark.gpu


def engine_spec(moe: bool, folder: Path) -> EngineSpec:
    save_pretrained(tiny_model(moe, seed=0), folder / "ckpt")
    small_pool = rollout(kv_cache_fraction=0.02, cuda_graph=False)
    return EngineSpec(model_path=str(folder / "ckpt"), dtype="bfloat16", device="cuda", rollout=small_pool)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cuda_ipc_syncs_bit_for_bit_with_a_pool_opened_once(moe: bool, tmp_path: Path) -> None:
    with EngineProcess(engine_spec(moe, tmp_path), timeout_s=TIMEOUT_S) as engine:
        sender = make_sender(
            "cuda_ipc", [engine.sync_channel], 8 / 1024, TIMEOUT_S, device="cuda", direct=False
        )
        (connected,) = sender.connect()
        assert connected.dtype == "bfloat16" and connected.device.startswith("cuda")
        pool = [b.data_ptr() for b in sender._pool]
        try:
            for step in range(3):
                trainer = tiny_model(moe, seed=10 + step).to("cuda")  # float32: cast to bfloat16 on the way
                result = TransportWeightSync(trainer, sender).sync(step + 1)
                assert result.checksum_ok, result.mismatched
                assert result.path == "buckets" and result.buckets > 0
                assert [b.data_ptr() for b in sender._pool] == pool
                assert_same_weights(exported(engine, tmp_path), trainer.to(torch.bfloat16).cpu())
        finally:
            sender.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_cast"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cuda_ipc_direct_copies_from_the_trainer_parameters(
    moe: bool, dtype: torch.dtype, tmp_path: Path
) -> None:
    with EngineProcess(engine_spec(moe, tmp_path), timeout_s=TIMEOUT_S) as engine:
        sender = make_sender("cuda_ipc", [engine.sync_channel], 8 / 1024, TIMEOUT_S, device="cuda")
        sender.connect()
        assert sender._pool == []  # direct mode allocates no bucket pool
        trainer = tiny_model(moe, seed=10).to(device="cuda", dtype=dtype)
        count = len(list(trainer.parameters()))
        sync = TransportWeightSync(trainer, sender)
        try:
            for step, shared in enumerate([count, 0, 1]):
                if step == 1:  # in place, queued on the trainer's stream: the engine's waits for it
                    optimizer_step(trainer, seed=step)
                if step == 2:  # a new storage: shared again
                    norm = trainer.model.norm.weight
                    norm.data = norm.data.clone().mul_(1.5)
                result = sync.sync(step + 1)
                assert result.checksum_ok, result.mismatched
                assert result.path == "direct" and result.shared == shared and result.buckets == 0
                assert result.bytes == sum(p.numel() * 2 for p in trainer.parameters())  # bf16 on the engine
                held = exported(engine, tmp_path)
                expected = {n: p.detach().to(torch.bfloat16).cpu() for n, p in trainer.named_parameters()}
                assert held.keys() == expected.keys()
                assert [n for n in expected if not torch.equal(held[n], expected[n])] == []
            assert sender._pool == []
        finally:
            sync.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buckets"])
def test_bench_sync_over_cuda_ipc_reports_its_ratio_to_the_copy_floor(
    direct: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "tiny", "--arch", "qwen3_moe", "--transport", "cuda_ipc", "--device", "cuda"]
    assert bench_sync([*argv, "--repeats", "2", *([] if direct else ["--no-direct"])]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert report["checksum_ok"] is True and report["path"] == ("direct" if direct else "buckets")
    assert report["copy_floor_s"] > 0 and report["ratio_to_copy_floor"] > 0
