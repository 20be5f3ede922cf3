"""GPU: the benchmarks' plumbing (`miles bench layers|attention|moe|rollout` on small shapes: they check that
each runs and reports, not the numbers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_bench_layers_times_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    """The decode-step microbenchmark runs each schedule as a CUDA graph (small shape: it checks the
    plumbing, not the numbers)."""
    from miles.bench import layers as bench_layers

    small = ["--model", "qwen3-0.6b", "--batch", "64", "--context", "128", "--iters", "2"]
    # two green-context sizes: the first pair of contexts must outlive the loop that made it
    assert bench_layers.main([*small, "--green-sms", "16,32", "--carveout", "0,16"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert set(report["ms"]) >= {"gemms", "attention", "serial", "serial-2mb", "overlap-2mb"}
    assert set(report["ms"]) >= {"attention-green-16", "overlap-gemm-green-32", "overlap-carve-16"}
    failed = {k: v for k, v in report["ms"].items() if not isinstance(v, float)}
    assert not failed and all(v > 0 for v in report["ms"].values()), failed
    assert report["ms"]["serial"] >= 0.5 * (report["ms"]["gemms"] + report["ms"]["attention"]), report


@pytest.mark.parametrize(("layout", "page"), [("NHD", 1), ("NHD", 16), ("HND", 16)])
def test_bench_attention_variants_agree_with_float32(
    layout: str, page: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """`miles bench attention` on a small batch: the engine's variants run in both page layouts and agree with
    its float32 reference (it checks the plumbing and the layouts, not the numbers)."""
    from miles.bench import attention as bench_attention

    args = ["--model", "qwen3-8b", "--batch", "4", "--context", "40", "--iters", "2", "--layout", layout]
    variants = "fa2-graph-strided-q,fa2-tensor-core,cuda-core-graph"
    timing = "eager" if page == 1 else "graph"
    assert (
        bench_attention.main([*args, "--page-size", str(page), "--variants", variants, "--timing", timing])
        == 0
    )
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [r["variant"] for r in report["results"]] == variants.split(",")
    for r in report["results"]:
        assert "error" not in r and r["rel_err"] < 1e-2 and r["seconds"] > 0, r


def test_bench_moe_focused_sweep_writes_tables_the_rollout_bench_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles.bench import moe as bench_moe
    from miles.models import fused_moe

    path = tmp_path / "tiles.json"
    argv = "--model tiny --tokens 64 --layers 2 --iters 2 --sweep --grid focused".split()
    assert bench_moe.main([*argv, "--save-configs", str(path)]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert report["results"][0]["sweep"]["pairs"]
    tuned = fused_moe.load_tables(str(path))
    # tiny: 64 tokens x top-2 of 4 experts = 32 pairs per expert, the last range; the others are untouched.
    assert (
        tuned.gate_up[:-1] == fused_moe.tables.gate_up[:-1] and tuned.down[:-1] == fused_moe.tables.down[:-1]
    )


def test_bench_rollout_roofline_takes_the_higher_copy_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    from miles.bench import rollout as bench

    argv = "--model tiny --num-prompts 4 --input-len 16 --output-len 8 --backend torch".split()
    assert bench.main([*argv, "--cuda-graph", "off"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    before, after = report["copy_bandwidth_before_after"]
    assert before > 1e11 and after > 1e11 and report["copy_bandwidth_bytes_per_s"] == max(before, after)
    assert 0 < report["decode_pct_of_roofline"] and report["decode_by_batch"]


def test_bench_moe_times_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    from miles.bench import moe as bench_moe

    assert bench_moe.main(["--model", "tiny", "--tokens", "8,64", "--layers", "2", "--iters", "2"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    for row in report["results"]:
        assert all(v > 0 for v in row["ms_per_layer"].values()), row
        assert row["fused_vs_grouped_rel_err"] < 1e-2, row
