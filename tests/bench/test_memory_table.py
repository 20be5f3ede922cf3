"""`python -m miles.bench.memory_table`: the projection's arithmetic on a hand-checked case, and the per-layer
figures of two measured depths predicting a third one's tensor bytes (exact on CPU; the activations come from
CUDA's device peaks only)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from miles.bench import memory_plan, memory_table
from miles.bench.memory_parts import parameter_counts
from miles.bench.memory_table import Layout, Measured, PerLayer, derive, project
from miles.errors import MilesUserError
from miles.models import ModelArgs
from miles.models.checkpoint import save_pretrained
from tests.support.trainer import tiny_model

ARGS = ModelArgs(
    model_type="qwen3_moe",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=10,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
)
PER = PerLayer(
    layer_params=1000,
    layer_expert_params=800,
    outside_params=500,
    per_param={"weight": 2.0, "grad": 4.0, "optimizer": 12.0, "engine": 0.0},
    outside={"weight": 1000.0, "grad": 2000.0, "optimizer": 6000.0, "engine": 0.0},
    activation_per_token_layer=10.0,
    activation_per_token_outside=100.0,
    micro_batch_tokens=100,
)


def test_projection_arithmetic_by_hand() -> None:
    # 8 GPUs, TP=2 (4 replicas), EP=4 (2 expert replicas); per layer 200 dense and 800 expert parameters
    layout = Layout(gpus=8, tensor=2, expert=4, expert_tensor=1, distributed_optimizer=True, offload=True)
    got = project(PER, ARGS, layout, micro_batch_tokens=100, capacity=1e6, reserve=1000)
    assert got["weights"] == 10 * 2 * (200 / 2 + 800 / 4) + 1000 / 2 == 6500
    assert got["grads"] == 10 * 4 * 300 + 2000 / 2 == 13000
    assert got["optimizer_state"] == 10 * 12 * (200 / 2 / 4 + 800 / 4 / 2) + 6000 / 2 / 4 == 15750
    assert got["engine_weights"] == 10 * 2 * 1000 + 1000 == 21000
    assert got["activations"] == (10 * 10 + 100) * 100 == 20000
    assert got["peak_update"] == 6500 + 13000 + 15750 + 20000
    assert got["update_with_engine"] == 55250 + 21000
    assert got["resident_rollout"] == 21000 + 6500  # the optimizer state is on the host
    assert got["kv_bytes_per_token"] == 2 * 10 * 2 * 8 * 2  # K and V, layers, KV heads, head_dim, bf16
    assert got["kv_cache"] == 1e6 - 1000 - 27500
    assert got["kv_tokens"] == 971500 // 640 == 1517 and got["fits"] is True
    kept = project(PER, ARGS, Layout(8, 2, 4, 1, True, False), 100, 1e6, 1000)
    assert kept["resident_rollout"] == 27500 + 15750
    whole = project(PER, ARGS, Layout(8, 2, 4, 1, False, False), 100, 1e6, 1000)
    assert whole["optimizer_state"] == 10 * 12 * (100 + 200) + 6000 / 2 == 39000
    tight = project(PER, ARGS, layout, micro_batch_tokens=100, capacity=70000, reserve=0)
    assert tight["kv_tokens"] > 0 and tight["fits"] is False  # the update does not fit beside the engine
    # rollout.release_weights_during_train: the engine's copy leaves the update, and is back for rollout
    released = replace(layout, release_engine_weights=True)
    freed = project(PER, ARGS, released, micro_batch_tokens=100, capacity=70000, reserve=0)
    assert freed["update_with_engine"] == freed["peak_update"] == 55250
    assert freed["resident_rollout"] == 27500 and freed["kv_cache"] == tight["kv_cache"]
    assert freed["fits"] is True
    assert project(PER, ARGS, released, 100, capacity=55000, reserve=0)["fits"] is False


def test_derive_splits_layers_from_the_rest_with_activations_per_token() -> None:
    # per layer: 10 / 20 / 60 / 10 bytes of weights / grads / state / engine copy, 3 bytes a token of
    # activations (10 tokens); outside: 5 / 10 / 30 / 5 and 7 bytes a token. peak(L) = 130 L + 120.
    def at(layers: int) -> Measured:
        parts = {"weight": 10, "grad": 20, "optimizer": 60, "engine": 10}
        outside = {"weight": 5, "grad": 10, "optimizer": 30, "engine": 5}
        return Measured(layers, {p: layers * parts[p] + outside[p] for p in parts}, 130 * layers + 120, 10)

    per = derive(at(4), at(2), ARGS)
    assert per.activation_per_token_layer == pytest.approx(3.0)
    assert per.activation_per_token_outside == pytest.approx(7.0)
    assert per.per_param["grad"] * per.layer_params == pytest.approx(20.0)
    assert per.outside == pytest.approx({"weight": 5, "grad": 10, "optimizer": 30, "engine": 5})
    with pytest.raises(MilesUserError, match="two depths"):
        derive(at(2), at(2), ARGS)


def test_two_measured_depths_predict_a_third(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for layers in (1, 2, 3):
        folder = tmp_path / f"moe{layers}"
        save_pretrained(tiny_model(num_hidden_layers=layers), folder)
        out = tmp_path / f"m{layers}.json"
        argv = f"--model {folder} --samples 4 --prompt-len 8 --response-len 8 --steps 1 --device cpu"
        assert (
            memory_plan.main([*argv.split(), "--variants", "distributed+selective", "--json-out", str(out)])
            == 0
        )
        files.append(str(out))
    capsys.readouterr()
    third = json.loads(Path(files[2]).read_text())["results"][0]
    assert third["weight_bytes"] > 0 and third["grad_bytes"] > 0 and third["optimizer_state_bytes"] > 0
    assert memory_table.main([*files[:2], "--layers", "3", "--gpus", "1", "--expert-parallel-size", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    per_gpu = json.loads(lines[0])["per_gpu"]
    assert per_gpu["weights"] == pytest.approx(third["weight_bytes"], rel=1e-12)
    assert per_gpu["grads"] == pytest.approx(third["grad_bytes"], rel=1e-12)
    assert per_gpu["optimizer_state"] == pytest.approx(third["optimizer_state_bytes"], rel=1e-12)
    assert per_gpu["engine_weights"] == pytest.approx(third["weight_bytes"], rel=1e-12)
    assert per_gpu["activations"] is None and per_gpu["fits"] is None  # no device peaks on CPU
    assert any(line.startswith("| optimizer state") for line in lines)
    argv = [*files[:2], "--layers", "3", "--gpus", "1", "--expert-parallel-size", "1"]
    assert memory_table.main([*argv, "--release-engine-weights"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[0])["layout"]["release_engine_weights"] is True
    assert any(line.startswith("| update, engine weights released too") for line in lines)
    # four experts: EP=2 on 2 GPUs holds half of every layer's experts; EP=3 is refused with the flag named
    two = [json.loads(Path(f).read_text())["results"][0]["weight_bytes"] for f in files[:2]]
    argv = [*files[:2], "--layers", "2", "--gpus", "2", "--expert-parallel-size", "2"]
    assert memory_table.main(argv) == 0
    split = json.loads(capsys.readouterr().out.splitlines()[0])["per_gpu"]
    counts = parameter_counts(ModelArgs(**json.loads(Path(files[0]).read_text())["model_args"]))
    experts_per_layer = (two[1] - two[0]) * counts["layer_experts"] / counts["layer"]
    assert split["weights"] == pytest.approx(two[1] - 2 * experts_per_layer / 2, rel=1e-12)
    with pytest.raises(MilesUserError, match="--expert-parallel-size=3 must divide the model's 4 experts"):
        memory_table.main([*files[:2], "--gpus", "3", "--expert-parallel-size", "3"])
