"""`miles bench sync` on CPU: one JSON line with the numbers the issue asks for, then a table."""

from __future__ import annotations

import json

import pytest

from miles.bench.sync import main
from miles.config import MilesConfig
from miles.weight_sync import check_transport, make_sender

KEYS = {
    "path",
    "seconds",
    "bytes",
    "gb_per_s",
    "copy_floor_s",
    "ratio_to_copy_floor",
    "checksum_ok",
    "transport",
    "trainer_peak_bytes",
    "engine_peak_bytes",
}


@pytest.mark.parametrize("transport, path", [("broadcast", "buckets"), ("shm", "direct")])
def test_bench_sync_prints_one_json_line_and_a_table(
    transport: str, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "tiny", "--arch", "qwen3_moe", "--transport", transport, "--device", "cpu"]
    assert main([*argv, "--bucket-mb", "0.05", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(lines[0])
    assert KEYS <= report.keys()
    assert report["checksum_ok"] is True and report["transport"] == transport and report["path"] == path
    assert report["buckets"] > 1 if path == "buckets" else report["buckets"] == 0
    assert report["ratio_to_copy_floor"] > 0
    assert report["bytes"] > 0 and report["seconds"] > 0 and report["copy_floor_s"] > 0
    assert report["engine_peak_bytes"] > 0 and report["memory_kind"] == "cpu_max_rss"
    assert any(line.startswith("| sync |") for line in lines)


def test_the_transport_is_a_config_field_with_errors_that_say_what_to_do() -> None:
    assert MilesConfig().weight_sync.transport == "auto"  # inprocess, or shm / cuda_ipc to an engine process
    with pytest.raises(
        ValueError, match="unknown weight_sync.transport='ipc'; use one of inprocess, cuda_ipc"
    ):
        check_transport("ipc")
    with pytest.raises(ValueError, match="InProcessWeightSync"):
        make_sender("inprocess", [object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="cuda_ipc packs on a GPU"):
        make_sender("cuda_ipc", [object()], device="cpu")  # type: ignore[list-item]
