"""Resuming never unpickles arbitrary objects (miles/safe_unpickle.py): a real distributed-optimizer and
DeepSpeed checkpoint loads; a crafted file in its place is refused, and its code never runs."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.distributed import SINGLE
from miles.errors import MilesUserError
from miles.rl.sharded_checkpoint import SHARDS_DIR, load_optimizer_shards, move_into, save_optimizer_shards
from miles.safe_unpickle import check_deepspeed_files, load_dcp_metadata, load_deepspeed_state
from tests.support.malicious import TouchesMarker, malicious_pickle
from tests.support.sharded import sharded_case_model, sharded_case_trainer


def test_the_crafted_pickle_runs_code_when_unpickled_plainly(tmp_path: Path) -> None:
    # the payload the refusals below stop does run under plain pickle (so those tests can fail)
    marker = tmp_path / "ran"
    pickle.loads(malicious_pickle(marker))
    assert marker.exists()


def _shards_checkpoint(tmp_path: Path) -> tuple:
    """A one-process distributed-optimizer checkpoint; its trainer, folder and `shards_meta`."""
    case = {"num_experts": 0}
    trainer = sharded_case_trainer(sharded_case_model(case), case, SINGLE, True)
    staging = save_optimizer_shards(trainer.sharded, tmp_path / "checkpoints", 1, SINGLE)
    folder = tmp_path / "step_000001"
    folder.mkdir()
    move_into(staging, folder)
    return trainer, folder, trainer.state_dict()["meta"]["distributed_optimizer"]


def test_dcp_metadata_holding_code_is_refused(tmp_path: Path) -> None:
    trainer, folder, meta = _shards_checkpoint(tmp_path)
    before = [b.exp_avg.clone() for b in trainer.sharded.buckets]
    for bucket in trainer.sharded.buckets:
        bucket.exp_avg.add_(1.0)
    load_optimizer_shards(trainer.sharded, folder, meta, SINGLE)  # the real one loads
    assert all(torch.equal(b.exp_avg, want) for b, want in zip(trainer.sharded.buckets, before))

    marker, metadata = tmp_path / "ran", folder / SHARDS_DIR / ".metadata"
    metadata.write_bytes(malicious_pickle(marker))
    with pytest.raises(MilesUserError, match=r"os\.system|posix\.system") as refused:
        load_optimizer_shards(trainer.sharded, folder, meta, SINGLE)
    assert str(metadata) in str(refused.value) and "may be malicious" in str(refused.value)
    assert not marker.exists()


def test_dcp_metadata_with_a_bytes_entry_is_refused(tmp_path: Path) -> None:
    # DCP reads a bytes entry with torch.load(weights_only=False): miles never writes one, so none is read
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _, folder, _ = _shards_checkpoint(tmp_path)
    path = folder / SHARDS_DIR / ".metadata"
    metadata = load_dcp_metadata(path)
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(MilesUserError, match="BytesStorageMetadata"):
        load_dcp_metadata(path)


def test_a_deepspeed_file_holding_code_is_refused_unread(tmp_path: Path) -> None:
    marker, folder = tmp_path / "ran", tmp_path / "state"
    folder.mkdir()
    shard = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": TouchesMarker(marker)}, shard)
    with pytest.raises(MilesUserError, match="may be malicious") as refused:
        load_deepspeed_state(shard, map_location="cpu")
    assert str(shard) in str(refused.value) and "system" in str(refused.value)
    with pytest.raises(MilesUserError, match="may be malicious"):
        check_deepspeed_files(folder)
    assert not marker.exists()


def test_deepspeed_resume_loads_its_state_and_refuses_a_crafted_shard(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from tests.support.deepspeed_refusal import refusal_worker

    mp.start_processes(refusal_worker, args=(str(tmp_path),), nprocs=1, start_method="spawn")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["restored"]  # ZeRO-3, bf16, CPU offload: the real state loads weights-only
    for refused in (report["refused"], report["engine_refused"]):
        assert "may be malicious" in refused and "optim_states.pt" in refused
    assert not (tmp_path / "ran").exists()


def test_the_wrapped_checkpoint_engine_saves_as_deepspeeds_and_loads_restricted(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from miles.trainer.deepspeed.safe_loading import SafeLoadingCheckpointEngine, check_loadable

    saved = []
    unrestricted = lambda *a, **k: pytest.fail("DeepSpeed's own (unrestricted) load ran")  # noqa: E731
    inner = SimpleNamespace(save=lambda sd, path: saved.append(path), load=unrestricted)
    wrapped = SafeLoadingCheckpointEngine(inner)
    wrapped.save({}, "x.pt")
    assert saved == ["x.pt"]  # saving stays DeepSpeed's own
    torch.save({"step": torch.tensor([3])}, tmp_path / "plain.pt")
    assert wrapped.load(str(tmp_path / "plain.pt"))["step"].tolist() == [3]

    universal = SimpleNamespace(load_universal_checkpoint=lambda: True)
    with pytest.raises(MilesUserError, match="load_universal"):
        check_loadable(universal, tmp_path)
