"""Float32 master weights for bf16 models (`trainer.master_weights`): updates below bf16's rounding survive,
gradients sum in float32, the model holds the masters rounded, checkpoints resume bit for bit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.config import AlgorithmConfig, OptimConfig
from miles.sample import Sample
from miles.trainer.master_weights import MasterWeights
from tests.support.trainer import (
    keep_gradients,
    make_trainer,
    random_samples,
    tiny_model,
)


def scored(n: int, seed: int = 3) -> list[Sample]:
    samples = random_samples(n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))
    return samples


ALGORITHM = AlgorithmConfig(tis=False)


def trained(model: torch.nn.Module, steps: int, lr: float, **cfg) -> torch.nn.Module:
    trainer = make_trainer(model, algorithm=copy.deepcopy(ALGORITHM), lr=lr, global_batch_size=8, **cfg)
    for _ in range(steps):
        trainer.train_step(scored(8))
    return trainer


def test_small_updates_survive_in_the_masters_and_follow_float32_training() -> None:
    """At lr 1e-4 Adam moves a weight by ~1e-4 a step, below bf16's rounding step for weights above ~0.03:
    updated in place, the bf16 weights mostly stay put; with masters they follow a float32 run from the same
    start, and the model holds exactly the masters rounded to bf16."""
    start = tiny_model(std=0.2).to(torch.bfloat16)
    steps, lr = 4, 1e-4
    reference = trained(copy.deepcopy(start).float(), steps, lr).model
    pure = trained(copy.deepcopy(start), steps, lr, master_weights=False).model
    mixed = trained(copy.deepcopy(start), steps, lr)
    assert mixed.masters is not None and pure.dtype == mixed.model.dtype == torch.bfloat16

    def distance(weights: dict[str, torch.Tensor]) -> float:
        return sum((weights[n].float() - p).abs().sum().item() for n, p in reference.named_parameters())

    moved = distance({n: p for n, p in start.named_parameters()})
    masters = dict(mixed.masters.named_masters())
    # the float32 run moved every weight ~lr per step; in place the bf16 weights lose most of it
    assert distance(dict(pure.named_parameters())) > 0.5 * moved
    assert distance(masters) < 0.2 * moved
    for name, param in mixed.model.named_parameters():
        assert masters[name].dtype == torch.float32
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name
        assert param.grad is None, name  # each micro-batch's bf16 gradient went into the float32 sum


def test_master_gradients_sum_in_float32() -> None:
    """Each backward's bf16 gradient is added to a float32 sum: 1 + 8 * 2**-10 is exact in float32, while
    bf16 (8 bits of mantissa) would round each partial sum back to 1."""
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    module = torch.nn.Module()
    module.weight = param
    masters = MasterWeights(module)
    for scale in [1.0] + [2.0**-10] * 8:
        (param * scale).sum().backward()
        assert param.grad is None  # dropped once folded in
    assert masters.masters[0].grad.dtype == torch.float32
    assert masters.masters[0].grad.tolist() == [1.0 + 8 * 2.0**-10] * 3
    masters.remove_hooks()
    (param * 2.0).sum().backward()  # without the hooks autograd keeps its own bf16 gradient again
    assert param.grad.dtype == torch.bfloat16 and masters.masters[0].grad.tolist() == [1.0 + 8 * 2.0**-10] * 3


def test_many_micro_batches_give_the_update_one_does() -> None:
    start = tiny_model(std=0.2).to(torch.bfloat16)
    grads = []
    for tokens in (4096, 8):
        trainer = make_trainer(
            copy.deepcopy(start),
            algorithm=copy.deepcopy(ALGORITHM),
            global_batch_size=8,
            micro_batch_tokens=tokens,
        )
        kept = keep_gradients(trainer)
        trainer.train_step(scored(8))
        grads.append(kept[0])
    a, b = grads
    assert all(g.dtype == torch.float32 for g in a.values())
    for name in a:
        # the forward itself is bf16 (its rounding depends on the micro-batch): a few percent apart
        assert (a[name] - b[name]).norm() <= 0.05 * a[name].norm() + 1e-6, name


def test_master_weights_resume_bit_for_bit_through_safetensors(tmp_path: Path) -> None:
    cfg = dict(lr=1e-3, optim=OptimConfig(grad_clip=1.0, schedule="cosine"), total=4)
    start = tiny_model(std=0.2).to(torch.bfloat16)

    def trainer_for(model: torch.nn.Module):
        trainer = make_trainer(
            model, algorithm=copy.deepcopy(ALGORITHM), lr=cfg["lr"], optim=cfg["optim"], global_batch_size=8
        )
        trainer.set_total_optimizer_steps(cfg["total"])
        return trainer

    whole = trainer_for(copy.deepcopy(start))
    for _ in range(2):
        whole.train_step(scored(8))
    state = whole.state_dict()
    assert {k for k in state["tensors"] if k.startswith("master.")} == {
        f"master.{n}" for n, _ in whole.model.named_parameters()
    }
    save_file(state["tensors"], tmp_path / "trainer.safetensors")
    (tmp_path / "trainer.json").write_text(json.dumps(state["meta"]))
    # a resumed run starts from the checkpoint's bf16 weights, which lost the masters' low bits
    resumed = trainer_for(copy.deepcopy(whole.model))
    resumed.load_state_dict(
        {
            "tensors": load_file(tmp_path / "trainer.safetensors"),
            "meta": json.loads((tmp_path / "trainer.json").read_text()),
        }
    )
    for _ in range(2):
        metrics_whole, metrics_resumed = whole.train_step(scored(8)), resumed.train_step(scored(8))
        assert metrics_whole["train/loss"] == metrics_resumed["train/loss"]
    mine, theirs = dict(resumed.masters.named_masters()), dict(whole.masters.named_masters())
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b) and torch.equal(mine[name], theirs[name]), name

    # a checkpoint without masters (saved by master_weights=false) takes the model's weights as masters
    without = {
        "tensors": {k: v for k, v in state["tensors"].items() if not k.startswith("master.")},
        "meta": state["meta"],
    }
    model = copy.deepcopy(whole.model)
    other = trainer_for(model)
    other.load_state_dict(without)
    for name, master in other.masters.named_masters():
        assert torch.equal(master, dict(model.named_parameters())[name].float()), name

    # resumed in float32, the weights themselves take the saved float32 masters (not their bf16 rounding)
    wide = trainer_for(copy.deepcopy(start).float())
    wide.load_state_dict(state)
    for name, param in wide.model.named_parameters():
        assert torch.equal(param, state["tensors"][f"master.{name}"]), name


def test_float32_models_have_no_masters_and_float16_is_refused() -> None:
    assert make_trainer(tiny_model()).masters is None
    assert make_trainer(tiny_model().to(torch.bfloat16), master_weights=False).masters is None
    with pytest.raises(ValueError, match="use model.dtype=bfloat16"):
        make_trainer(tiny_model().to(torch.float16))


@pytest.mark.slow
def test_grpo_math_in_bf16_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The loop with `model.dtype=bfloat16` (engine and trainer on the same bf16 module, float32 masters in
    the optimizer): checksums hold, and a run resumed from its step-1 checkpoint repeats step 2 exactly."""
    from tests.support.cli import run_miles
    from tests.trainer.test_megatron import COMMON  # 2 steps, a checkpoint after each, small batches, on CPU

    common = [*COMMON, "model.dtype=bfloat16"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    out = run_miles(tmp_path, *common, run_dir=whole)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(
        tmp_path, *common, f"trainer.resume_from={whole / 'checkpoints' / 'step_000001'}", run_dir=resumed
    )
    assert out.returncode == 0, out.stderr[-3000:]

    def last(run: Path) -> dict:
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])

    a, b = last(whole), last(resumed)
    assert a["step"] == b["step"] == 2 and a["sync/checksum_ok"] == 1.0
    for key in ("reward/mean", "train/loss", "train/grad_norm", "response_length/mean"):
        assert a[key] == b[key], key
    final = [
        load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors")) for run in (whole, resumed)
    ]
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, final[1][k]) for k, v in final[0].items())
    masters = load_file(str(whole / "checkpoints" / "step_000002" / "resume" / "trainer_state.safetensors"))
    assert any(k.startswith("master.") and v.dtype == torch.float32 for k, v in masters.items())


@pytest.mark.gpu
def test_masters_on_cuda_take_the_fused_update_and_follow_float32() -> None:
    cuda = torch.device("cuda")
    start = tiny_model(std=0.2).to(device=cuda, dtype=torch.bfloat16)
    reference = trained(copy.deepcopy(start).float(), 4, 1e-4).model
    mixed = trained(copy.deepcopy(start), 4, 1e-4)
    assert all(group["fused"] for group in mixed.optimizer.param_groups)
    masters = dict(mixed.masters.named_masters())
    moved = sum(
        (p - s.float()).abs().sum().item() for p, s in zip(reference.parameters(), start.parameters())
    )
    apart = sum((masters[n] - p).abs().sum().item() for n, p in reference.named_parameters())
    assert apart < 0.2 * moved
    for name, param in mixed.model.named_parameters():
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name
    # what a colocated engine leaves free: AdamW's moments before the first update, the gradients always
    elements = sum(p.numel() for p in start.parameters())
    fresh = make_trainer(copy.deepcopy(start))
    assert fresh.memory_reserve_bytes() == 3 * 4 * elements
    assert mixed.memory_reserve_bytes() == 4 * elements
    assert all(m.grad is None for m in masters.values())  # freed after the update, for the engine


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "release"), [("torch", False), ("megatron", False), ("torch", True)])
def test_grpo_math_on_cuda_with_bf16_weights(backend: str, release: bool, tmp_path: Path) -> None:
    """The GPU form of the run: a bf16 engine (flashinfer, CUDA graphs) on the weights the trainer rounds
    its float32 masters into; the checksums hold and the engine's logprobs stay near the trainer's."""
    from miles.tracking import read_records
    from tests.support.cli import run_miles

    if backend == "megatron":
        pytest.importorskip("megatron.core")
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        f"trainer.backend={backend}",
        "model.dtype=bfloat16",
        "model.device=cuda",
        "rollout.backend=torch",  # flashinfer would JIT-compile kernels for this model's head_dim 16 (minutes)
        f"rollout.release_kv_during_train={str(release).lower()}",
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
        assert ("time/kv_release" in record) == release
