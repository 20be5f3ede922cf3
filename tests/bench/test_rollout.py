"""`miles bench rollout` on CPU: the JSON it prints, the profiler window, the HF baseline, and the floors'
byte and FLOP counts against the published Qwen3 parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.bench import layers as bench_layers
from miles.bench import rollout as bench
from miles.bench.common import decode_flops_per_token, decode_weight_bytes
from miles.bench.profiling import decode_by_batch, record_decode_steps
from miles.models.presets import preset_args
from miles.rollout.kv.pool import KVLayout


def run_bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert bench.main([*argv, "--device", "cpu"]) == 0  # the CPU report, on a GPU machine too
    out = capsys.readouterr().out
    return json.loads(out.splitlines()[0])


def test_bench_rollout_reports_the_work_it_did(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    r = run_bench(
        capsys,
        "--model", "tiny", "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--n", "2",
        "--profile", str(tmp_path / "prof"), "--profile-start", "2", "--profile-steps", "3",
    )  # fmt: skip
    assert r["output_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    # Each prompt is computed once for its two samples (the second recomputes only the last token, whose
    # logits it samples from); the rest of the prompt tokens came from the cache.
    assert r["prefill_tokens"] + r["cached_prompt_tokens"] == 6 * 2 * 12
    assert r["prefill_tokens"] <= 6 * 12 + 6
    assert r["prefix_hit_rate"] == pytest.approx(r["cached_prompt_tokens"] / (6 * 2 * 12))
    assert r["preemptions"] == 0
    assert "roofline_output_tokens_per_s" not in r  # the bytes roofline is a GPU number
    assert r["profile_ms_per_step"] > 0 and r["profile_wall_ms_per_step"] > 0
    assert any("mm" in e["name"] or "linear" in e["name"] for e in r["profile_top"])
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    assert trace["traceEvents"]


def test_bench_rollout_hf_baseline_uses_return_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench(
        capsys,
        "--model", "tiny", "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--n", "2",
        "--hf-baseline", "--radix-cache", "off",
    )  # fmt: skip
    assert r["prefill_tokens"] == 3 * 2 * 8 and r["cached_prompt_tokens"] == 0
    assert r["hf_num_prompts"] == 3 and r["hf_output_len"] == 4
    assert r["hf_logits_rel_err"] < 1e-5  # the baseline runs the same weights
    assert r["speedup_vs_hf"] == pytest.approx(r["output_tokens_per_s"] / r["hf_output_tokens_per_s"])


def test_bench_rollout_repeat_reports_medians_and_one_run_of_counters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = run_bench(
        capsys,
        "--model", "tiny", "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--n", "2",
        "--hf-baseline", "--repeat", "3",
    )  # fmt: skip
    assert len(r["wall_s_runs"]) == 3 and r["wall_s"] == sorted(r["wall_s_runs"])[1]
    assert len(r["hf_wall_s_runs"]) == 3 and r["hf_wall_s"] == sorted(r["hf_wall_s_runs"])[1]
    assert r["prefill_tokens"] + r["cached_prompt_tokens"] == 3 * 2 * 8  # the last run's, not three runs'
    assert r["output_tokens_per_s"] == pytest.approx(3 * 2 * 4 / r["wall_s"])
    # On CPU each engine run is paired with the baseline run right after it.
    pairs = sorted(hf / ours for hf, ours in zip(r["hf_wall_s_runs"], r["wall_s_runs"]))
    assert r["speedup_vs_hf_paired"] == pytest.approx(pairs[1])
    assert r["speedup_vs_hf_best"] == pytest.approx(min(r["hf_wall_s_runs"]) / min(r["wall_s_runs"]))
    with pytest.raises(SystemExit, match="--repeat"):
        bench.main(["--model", "tiny", "--device", "cpu", "--repeat", "2", "--profile", "/tmp/unused"])


def test_bench_rollout_host_profile_lists_the_engine_step(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench(
        capsys,
        "--model", "tiny", "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--host-profile",
    )  # fmt: skip
    top = r["host_profile_top"]
    assert any(e["function"].startswith("engine.py") and e["function"].endswith("(step)") for e in top)
    assert all(e["cum_ms_per_step"] >= e["self_ms_per_step"] >= 0 for e in top)
    assert [e["cum_ms_per_step"] for e in top] == sorted((e["cum_ms_per_step"] for e in top), reverse=True)


def test_device_idle_merges_overlapping_kernels_and_names_the_gaps() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from miles.bench.profiling import device_idle

    def event(start: float, end: float, name: str, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
        return SimpleNamespace(
            device_type=device, name=name, time_range=SimpleNamespace(start=start, end=end)
        )

    # Kernels over [0, 4] and [6, 10] (two overlap, one nested); CPU ops and empty spans do not count.
    kernels = [
        event(0, 3, "a"),
        event(1, 4, "b"),
        event(6, 10, "c"),
        event(7, 8, "d"),
        event(2, 9, "op", DeviceType.CPU),
        event(5, 5, "empty"),
    ]
    idle = device_idle(kernels)
    assert idle is not None and idle["busy_fraction"] == 0.8
    assert idle["longest_gaps"] == [{"ms": 0.002, "after": "b", "before": "c"}]
    assert (idle["short_gaps"], idle["short_gaps_ms"], idle["long_gaps_ms"]) == (1, 0.002, 0.0)
    # A 30 us wait for the host counts as a long gap, the 2 us boundary as a short one.
    idle = device_idle([*kernels, event(40, 41, "e")])
    assert idle is not None and (idle["short_gaps"], idle["short_gaps_ms"], idle["long_gaps_ms"]) == (
        1,
        0.002,
        0.03,
    )
    assert device_idle([event(0, 1, "op", DeviceType.CPU)]) is None


def test_floor_counts_match_published_qwen3_sizes() -> None:
    # Qwen3-8B: 6.95B parameters besides the embedding and the (untied) lm_head, which is 151936 x 4096.
    args = preset_args(None, "qwen3-8b")
    lm_head = 151936 * 4096
    assert decode_weight_bytes(args, torch.bfloat16, 512) == pytest.approx(2 * (6.95e9 + lm_head), rel=0.01)
    assert decode_flops_per_token(args, 0) == pytest.approx(2 * (6.95e9 + lm_head), rel=0.01)
    # Attention FLOPs: q.k and p.v, 2 FLOPs each per head dimension per cached token per head per layer.
    assert decode_flops_per_token(args, 1000) - decode_flops_per_token(args, 0) == 4 * 1000 * 32 * 128 * 36
    # Qwen3-30B-A3B: 3.3B activated of 30.5B; one token touches only its 8 of 128 experts per layer, a
    # large batch all of them.
    moe = preset_args(None, "qwen3-30b-a3b")
    embedding = 151936 * 2048
    assert decode_flops_per_token(moe, 0) == pytest.approx(2 * (3.3e9 - embedding), rel=0.03)
    assert decode_weight_bytes(moe, torch.bfloat16, 1) == pytest.approx(2 * (3.3e9 - embedding), rel=0.03)
    assert decode_weight_bytes(moe, torch.bfloat16, 4096) == pytest.approx(2 * (30.5e9 - embedding), rel=0.03)


def test_bench_layers_and_moe_need_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from miles.bench import moe as bench_moe

    if torch.cuda.is_available():
        pytest.skip("has a GPU; tests/bench/test_gpu.py runs them")
    assert bench_layers.main(["--model", "qwen3-0.6b"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert bench_moe.main(["--model", "tiny"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_bench_profile_window_past_the_end_of_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A window the run ends inside of is closed and reported with the steps it held; one never reached
    says so."""
    argv = ["--model", "tiny", "--num-prompts", "2", "--input-len", "6", "--output-len", "3"]
    r = run_bench(
        capsys, *argv, "--profile", str(tmp_path / "a"), "--profile-start", "1", "--profile-steps", "50"
    )
    assert 1 <= r["profile_steps"] < 50 and (tmp_path / "a" / "trace.json").exists()
    assert torch.autograd.profiler._is_profiler_enabled is False
    assert (
        bench.main([*argv, "--device", "cpu", "--profile", str(tmp_path / "b"), "--profile-start", "500"])
        == 0
    )
    out = capsys.readouterr()
    assert "profile_steps" not in json.loads(out.out.splitlines()[0])
    assert "never reached" in out.err and not (tmp_path / "b" / "trace.json").exists()
    (tmp_path / "c").write_text("a file")
    with pytest.raises(FileExistsError):  # refused before the run, not after it
        bench.main([*argv, "--device", "cpu", "--profile", str(tmp_path / "c")])


def test_decode_by_batch_bins_steps_and_compares_each_bin_to_its_roofline() -> None:
    args = preset_args(None, "qwen3-8b")
    bw = 4.0e12
    # Two waves: 3 steps at batch 700 (context 800), 2 at batch 300 (context 900).
    steps = [(700, 700 * 800, 0.040, 0.001)] * 3 + [(300, 300 * 900, 0.020, 0.015)] * 2
    rows = decode_by_batch(steps, args, torch.bfloat16, bw)
    assert [(r["batch_lo"], r["steps"]) for r in rows] == [(256, 2), (640, 3)]
    kv_per_token = 36 * 8 * 128 * 2 * 2  # layers x kv heads x head_dim x (k, v) x bf16
    low = rows[0]
    assert low["avg_batch"] == 300 and low["avg_context"] == 900 and low["ms_per_step"] == pytest.approx(20.0)
    assert low["host_ms_per_step"] == pytest.approx(5.0) and rows[1]["host_ms_per_step"] == pytest.approx(
        39.0
    )
    roof = 1e3 * (decode_weight_bytes(args, torch.bfloat16, 300) + 300 * 900 * kv_per_token) / bw
    assert low["roofline_ms_per_step"] == pytest.approx(roof)
    assert low["pct_of_roofline"] == pytest.approx(100 * roof / 20.0)


def test_record_decode_steps_feeds_decode_by_batch() -> None:
    """Only pure decode steps are recorded (as in `decode_s`); a tight token budget mixes decode rows into
    prefill steps, which `decode_tokens` counts and the decode rate must not."""
    from miles.config import RolloutConfig
    from miles.rollout import Engine, SamplingParams
    from tests.support.models import tiny_model

    model = tiny_model()
    cfg = RolloutConfig(backend="torch", max_running_requests=8, max_batch_tokens=64)
    engine = Engine(model, None, cfg)
    steps: list[tuple[int, int, float, float]] = []
    record_decode_steps(engine, steps)
    prompts = [[1 + i, 2, 3] * 13 for i in range(6)]  # 39 tokens each: one prefill per step
    engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0))
    st = engine.stats
    assert st.decode_step_tokens < st.decode_tokens, "the budget was meant to mix decodes into prefills"
    assert len(steps) == st.decode_steps and sum(s[0] for s in steps) == st.decode_step_tokens
    assert sum(s[1] for s in steps) == st.decode_kv_tokens
    assert all(s[2] >= s[3] >= 0 for s in steps)
    rows = decode_by_batch(steps, model.args, torch.float32, 1e12)
    assert sum(r["steps"] for r in rows) == len(steps)
    assert all(0 <= r["host_ms_per_step"] <= r["ms_per_step"] for r in rows)


def test_decode_by_batch_averages_the_moe_roofline_per_step() -> None:
    """The experts a step touches grow less than linearly with its batch: a bin's roofline is the mean of its
    steps', not the roofline at the bin's mean batch."""
    args = preset_args(None, "qwen3-30b-a3b")
    steps = [(1, 500, 0.01, 0.0), (63, 63 * 500, 0.01, 0.0)]
    (row,) = decode_by_batch(steps, args, torch.bfloat16, 4e12)
    kv = KVLayout.for_model(args, torch.bfloat16, 1).bytes_per_token
    per_step = [decode_weight_bytes(args, torch.bfloat16, b) + t * kv for b, t, _, _ in steps]
    assert row["roofline_ms_per_step"] == pytest.approx(1e3 * sum(per_step) / 2 / 4e12)
    at_mean_batch = 1e3 * (decode_weight_bytes(args, torch.bfloat16, 32) + 32 * 500 * kv) / 4e12
    assert row["roofline_ms_per_step"] < 0.95 * at_mean_batch
