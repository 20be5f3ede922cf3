"""`miles bench train`: one JSON line and a table per backend, the backends agreeing on the first update."""

from __future__ import annotations

import json
import re

import pytest
import torch

from miles.bench import train as bench_train
from miles.bench.update_profile import classify
from miles.errors import MilesUserError


def _run(capsys, *args: str) -> dict:
    argv = ["--model", "tiny", "--samples", "4", "--prompt-len", "6", "--response-len", "5", "--steps", "1"]
    assert bench_train.main([*argv, *args]) == 0
    out = capsys.readouterr().out
    assert "| backend | s / update |" in out
    return json.loads(out.splitlines()[0])


def test_both_backends_report_the_same_first_update(capsys) -> None:
    report = _run(capsys, "--arch", "qwen3_moe", "--precision", "fp32", "--device", "cpu")
    assert [r["backend"] for r in report["results"]] == ["torch", "megatron"]
    torch_run, megatron_run = report["results"]
    for r in report["results"]:
        assert r["seconds_per_update"] > 0 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and r["peak_memory_bytes"] is None  # CPU: no peak FLOP/s, no device memory
    assert megatron_run["first_loss"] == pytest.approx(torch_run["first_loss"], rel=1e-4, abs=1e-9)
    assert megatron_run["first_grad_norm"] == pytest.approx(torch_run["first_grad_norm"], rel=1e-4)


def test_recompute_and_the_distributed_optimizer_leave_the_first_update_unchanged(capsys) -> None:
    args = ("--arch", "qwen3_moe", "--precision", "fp32", "--device", "cpu")
    plain = _run(capsys, *args)["results"]
    both = _run(capsys, *args, "--recompute", "full", "--distributed-optimizer")["results"]
    for a, b in zip(plain, both):
        assert b["first_loss"] == pytest.approx(a["first_loss"], rel=1e-6, abs=1e-9)
        assert b["first_grad_norm"] == pytest.approx(a["first_grad_norm"], rel=1e-6)


def test_expert_parallel_over_two_ranks_gives_the_one_process_update(capsys) -> None:
    pytest.importorskip("megatron.core")
    args = ("--arch", "qwen3_moe", "--precision", "fp32", "--device", "cpu", "--backend", "megatron")
    one = _run(capsys, *args)
    two = _run(capsys, *args, "--expert-parallel-size", "2", "--nproc", "2")  # 2 launched ranks, gloo
    assert "ranks" not in one and "peak_memory_bytes_per_rank" not in one["results"][0]  # today's keys
    assert two["ranks"] == 2 and two["parallel"] == {"tensor": 1, "expert": 2, "expert_tensor": 1}
    single, split = one["results"][0], two["results"][0]
    assert split["first_loss"] == pytest.approx(single["first_loss"], rel=1e-4, abs=1e-9)
    assert split["first_grad_norm"] == pytest.approx(single["first_grad_norm"], rel=1e-4)
    assert split["tokens_per_s"] > 0 and split["mfu"] is None
    assert split["peak_memory_bytes_per_rank"] == [None, None]  # CPU: no device memory
    assert split["peak_host_bytes"] == max(split["peak_host_bytes_per_rank"]) > 0


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            ["--expert-parallel-size", "2"],
            "--expert-parallel-size and --expert-tensor-parallel-size need --backend megatron",
        ),
        (["--backend", "megatron", "--expert-parallel-size", "2"], "must divide --nproc=1"),
        (
            ["--backend", "megatron", "--expert-parallel-size", "3", "--nproc", "3"],
            "--expert-parallel-size=3 must divide the model's 4 experts",
        ),
        (
            ["--backend", "megatron", "--tensor-parallel-size", "3", "--expert-tensor-parallel-size", "1"]
            + ["--nproc", "3"],
            "--tensor-parallel-size=3 must divide the model's {'num_attention_heads': 4",
        ),
        (["--backend", "megatron", "--nproc", "0"], "--nproc must be at least 1"),
    ],
)
def test_sizes_the_trainer_refuses_are_refused_naming_the_flag(sizes: list[str], message: str) -> None:
    argv = ["--model", "tiny", "--arch", "qwen3_moe", "--device", "cpu", *sizes]
    with pytest.raises(MilesUserError, match=re.escape(message)):
        bench_train.main(argv)


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown --backend"):
        bench_train.main(["--model", "tiny", "--arch", "qwen3", "--backend", "fsdp"])


@pytest.mark.gpu
def test_profile_lists_the_costliest_kernels_on_cuda(capsys) -> None:
    assert torch.cuda.is_available()
    report = _run(capsys, "--arch", "qwen3", "--backend", "torch", "--profile", "3")
    view = report["results"][0]["top_kernels"]
    assert view["device_ms"] > 0 and len(view["kernels"]) == 3
    assert view["kernels"][0]["ms"] >= view["kernels"][-1]["ms"]
    assert view["classes"]["gemm"] > 0 and view["device_ms"] == pytest.approx(sum(view["classes"].values()))
    assert view["ops"] and view["ops"][0]["op"].startswith("aten::")


def test_profile_on_cpu_sums_the_operators_by_kind_and_names_their_shapes(capsys) -> None:
    report = _run(
        capsys,
        "--arch",
        "qwen3_moe",
        "--backend",
        "megatron",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--profile",
        "500",  # every operator: on a tiny model the top few are noise (scalar copies, allocations)
    )
    out = capsys.readouterr().out  # _run consumed the table; the JSON holds the views
    view = report["results"][0]["top_kernels"]
    assert view["kernels"] == []  # no device kernels on CPU
    assert view["device_ms"] == pytest.approx(sum(view["classes"].values())) and view["classes"]["gemm"] > 0
    ms = [op["ms"] for op in view["ops"]]
    assert 0 < len(ms) <= 500 and ms == sorted(ms, reverse=True)
    assert all(op["op"].startswith("aten::") for op in view["ops"])
    gemms = [op for op in view["ops"] if op["op"] in ("aten::mm", "aten::addmm", "aten::bmm")]
    assert gemms and all(op["shapes"].startswith("[[") for op in gemms)  # a GEMM names its operands
    # and its caller: a Python frame outside torch (megatron's linear layer, this repository's experts) or,
    # in the backward, the autograd node that ran it
    callers = {op["where"] for op in gemms}
    assert any(c.startswith("megatron/core/") for c in callers)
    assert any(c.startswith("trainer/megatron/") for c in callers) and "GroupedMmBackward0" in callers
    assert out == ""


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        (
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, cutlass",
            "attention",
        ),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorB",
            "copy",
        ),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3",
            "elementwise",
        ),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace):",
            "optimizer",
        ),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float", "softmax"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::", "copy"),
        ("aten::_grouped_mm", "gemm"),
        ("aten::index_add_", "copy"),
    ],
)
def test_kernels_are_classified_by_the_work_they_do(name: str, kind: str) -> None:
    assert classify(name) == kind
