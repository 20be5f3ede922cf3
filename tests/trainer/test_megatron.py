"""`trainer.backend=megatron`: megatron-core's GPTModel as the trained policy, on CPU (float32).

References nobody here wrote: transformers' Qwen3 / Qwen3-MoE / Llama logits, and megatron-core's own
q/k/v split. The trainer's update on the megatron policy must equal the torch backend's on our model, and
the RL loop must run, resume and go data-parallel with it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from miles.errors import MilesUserError
from miles.models import ModelArgs, VarlenAttention
from miles.models.checkpoint import iter_hf_tensors
from miles.tracking import read_records
from miles.trainer.backends import build_policy, check_backend, copy_policy_into
from miles.trainer.megatron.layout import from_megatron, qkv_from_megatron, qkv_to_megatron, to_megatron
from miles.trainer.megatron.policy import MegatronPolicy
from tests.models.test_parity import _build, random_ids, relative_error
from tests.support.cli import run_miles
from tests.support.dp import make_trainer, scored_samples, tiny_moe
from tests.support.placements import RESUMABLE_GRPO

SUPPORTED = [
    "qwen3_hd20_gqa3_untied",
    "qwen3_hd12_mqa_tied",
    "qwen3_moe_step2_mlponly_unnormed",
    "qwen3_moe_normed_tied",
    "llama_mha_tied_linear",
]


@pytest.fixture
def hf_case(tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, ours loaded from its checkpoint) of a parity case, built once per session."""

    def build(name: str) -> tuple:
        _, hf, _, ours = _build(name, tmp_path_factory)
        ours.zero_grad(set_to_none=True)  # shared with the parity tests: no gradient left from another test
        return hf, ours

    return build


@pytest.mark.parametrize("name", SUPPORTED)
@torch.no_grad()
def test_megatron_logits_match_transformers(name: str, hf_case) -> None:
    """Our weights through megatron's layers (packed: two sequences in one forward) give transformers'
    logits, and the weights converted back are ours bit for bit."""
    hf, ours = hf_case(name)
    policy = MegatronPolicy.from_model(ours)
    ids = random_ids(hf.config.vocab_size, batch=2, length=40, seed=2)
    expected = hf(ids).logits
    positions = torch.arange(40).repeat(2)
    hidden = policy.forward_packed(ids.reshape(-1), positions, VarlenAttention([0, 40, 80])).hidden
    logits = (hidden @ policy.lm_head.weight.T).view(2, 40, -1)
    assert relative_error(logits, expected) <= 1e-5, name
    back = dict(policy.engine_weights())
    own = dict(ours.named_parameters())
    assert back.keys() == own.keys() - ({"lm_head.weight"} if ours.args.tie_word_embeddings else set())
    assert all(torch.equal(back[k], own[k]) for k in back)


@pytest.mark.parametrize("name", SUPPORTED)
def test_megatron_gradients_match_ours_per_parameter(name: str, hf_case) -> None:
    """The gradient of a weighted logprob sum over packed sequences, parameter by parameter (a global
    gradient norm, or one AdamW step, would hide a small tensor's or a scaled gradient)."""
    _, ours = hf_case(name)
    policy = MegatronPolicy.from_model(ours)
    lengths = [13, 7, 20]
    cu_seqlens = [0, 13, 20, 40]
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ours.args.vocab_size, (40,), generator=generator)
    targets = torch.randint(0, ours.args.vocab_size, (40,), generator=generator)
    weights = torch.randn(40, generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    for model in (ours, policy):
        hidden = model.forward_packed(ids, positions, VarlenAttention(cu_seqlens)).hidden
        logprobs = (hidden @ model.lm_head.weight.T).log_softmax(-1)
        (logprobs.gather(-1, targets[:, None])[:, 0] * weights).sum().backward()
    theirs = [(n, p.grad) for n, p in policy.gpt.named_parameters()]
    assert all(grad is not None for _, grad in theirs)
    expected = {n: p.grad for n, p in ours.named_parameters()}
    converted = dict(from_megatron(theirs, ours.args))
    assert converted.keys() == expected.keys() - (
        {"lm_head.weight"} if ours.args.tie_word_embeddings else set()
    )
    for param, grad in converted.items():
        assert relative_error(grad, expected[param]) <= 1e-5, (name, param)


def test_qkv_layout_is_megatrons_per_group_split() -> None:
    """Rows labelled by (part, head, dim) land where megatron's `get_query_key_value_tensors` reads them:
    a [groups, (q per group + 2) * d] view split into q, k, v per group (restated here; the logits and
    gradient tests above check the layout through megatron's own code)."""
    args = ModelArgs(
        model_type="qwen3", hidden_size=8, num_attention_heads=6, num_key_value_heads=2, head_dim=3
    )
    heads, groups, d = 6, 2, 3
    labels = [("q", h, i) for h in range(heads) for i in range(d)]
    labels += [("k", g, i) for g in range(groups) for i in range(d)]
    labels += [("v", g, i) for g in range(groups) for i in range(d)]
    qkv = torch.arange(len(labels), dtype=torch.float32)[:, None].repeat(1, 8)
    megatron = qkv_to_megatron(qkv, args)
    per_group = megatron[:, 0].long().view(groups, (heads // groups + 2) * d)
    for g in range(groups):
        q, k, v = per_group[g].split([heads // groups * d, d, d])
        assert [labels[i] for i in q.tolist()] == [
            ("q", h, i) for h in (3 * g, 3 * g + 1, 3 * g + 2) for i in range(d)
        ]
        assert [labels[i] for i in k.tolist()] == [("k", g, i) for i in range(d)]
        assert [labels[i] for i in v.tolist()] == [("v", g, i) for i in range(d)]
    assert torch.equal(qkv_from_megatron(megatron, args), qkv)


def test_every_parameter_maps_and_unknown_names_fail() -> None:
    model = tiny_moe()
    named = list(model.named_parameters())
    converted = list(to_megatron(named, model.args))
    assert len({n for n, _ in converted}) == len(converted)
    back = dict(from_megatron(converted, model.args))
    assert back.keys() == dict(named).keys()
    assert all(torch.equal(back[n], p) for n, p in named)
    with pytest.raises(KeyError, match="no megatron name"):
        list(to_megatron([("model.layers.0.mlp.new_proj.weight", torch.zeros(1))], model.args))
    assert {n for n, _ in converted if "experts" in n} == {
        f"decoder.layers.{i}.mlp.experts.weight{j}"
        for i in range(model.args.num_hidden_layers)
        for j in (1, 2)
    }  # the stacked layout of GroupedExperts, not SequentialMLP's modules
    sequential = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    with pytest.raises(KeyError, match="no model name"):
        list(from_megatron([(sequential, torch.zeros(1))], model.args))


def test_grouped_experts_equal_the_per_expert_loop_and_the_engine_experts(monkeypatch) -> None:
    # megatron's experts slot: the grouped GEMMs, the unbind loop and our model's `Experts` compute the same
    # function (probabilities applied after the activation, as megatron's MLP applies them); expert 2 gets
    # no tokens
    from types import SimpleNamespace

    import miles.trainer.megatron.experts as megatron_experts
    from miles.models.moe import Experts

    config = SimpleNamespace(add_bias_linear=False, hidden_size=16, moe_ffn_hidden_size=8)
    experts = megatron_experts.GroupedExperts(4, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.weight1.copy_(torch.randn(4, 16, 16, generator=gen) * 0.3)
        experts.weight2.copy_(torch.randn(4, 16, 8, generator=gen) * 0.3)
    counts = torch.tensor([3, 5, 0, 4])
    x = torch.randn(12, 16, generator=gen, requires_grad=True)
    probs = torch.rand(12, generator=gen)

    def run() -> tuple[torch.Tensor, ...]:
        experts.zero_grad(set_to_none=True)
        out, bias = experts(x, counts, probs)
        assert bias is None
        grads = torch.autograd.grad(out.square().sum(), [x, experts.weight1, experts.weight2])
        return (out.detach(), *grads)

    assert megatron_experts._grouped_mm_applies(x, experts.weight1, experts.weight2)
    grouped = run()
    monkeypatch.setattr(megatron_experts, "_grouped_mm_applies", lambda *a: False)
    looped = run()
    for g, w in zip(grouped, looped):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert grouped[2][2].abs().sum() == 0  # no tokens, no gradient

    ours = Experts(4, 16, 8)
    with torch.no_grad():
        ours.gate_up_proj.copy_(experts.weight1)
        ours.down_proj.copy_(experts.weight2)
    chosen = torch.repeat_interleave(torch.arange(4), counts)[:, None]
    torch.testing.assert_close(ours(x.detach(), chosen, probs[:, None]), grouped[0], atol=1e-5, rtol=1e-5)


def test_unsupported_settings_fail_at_start_with_what_to_do(hf_case) -> None:
    _, biased = hf_case("llama_rope_llama3_bias")
    with pytest.raises(MilesUserError, match="biases.*trainer.backend=torch"):
        MegatronPolicy.from_model(biased)
    _, yarn = hf_case("qwen3_rope_yarn")
    with pytest.raises(MilesUserError, match="YaRN"):
        MegatronPolicy.from_model(yarn)
    with pytest.raises(MilesUserError, match="unknown trainer.backend"):
        check_backend("jax")


@pytest.mark.parametrize(
    "case",
    [
        {"global_batch_size": 12, "loss_agg": "token_mean"},  # on-policy: one optimizer step
        {"global_batch_size": 6, "loss_agg": "seq_mean_token_mean", "epochs": 2, "tis": True},
    ],
    ids=["one_step", "two_steps_two_epochs_tis"],
)
def test_megatron_update_equals_the_torch_backends(case: dict) -> None:
    """The same trainer on megatron's modules and on ours: same metrics, same weights after the update."""
    samples = scored_samples(12)
    ours = tiny_moe()
    policy = MegatronPolicy.from_model(copy.deepcopy(ours))
    torch_metrics = make_trainer(ours, case, dp=_single()).train_step(copy.deepcopy(samples))
    megatron_trainer = make_trainer(policy, case, dp=_single())
    megatron_metrics = megatron_trainer.train_step(copy.deepcopy(samples))
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/clipfrac"):
        assert megatron_metrics[key] == pytest.approx(torch_metrics[key], rel=1e-4, abs=1e-6), key
    trained = dict(ours.named_parameters())
    # AdamW's first steps move every weight by ~lr whatever the gradient's size, so float rounding in
    # small gradients shows up, more after several steps. The torch backend's experts scale by the routing
    # weight after the down projection's backward GEMM, megatron's before it (miles/models/routed_experts.py):
    # one rounding apart, ~1e-5 of the weights after one step.
    tolerance = 2e-5 if case["global_batch_size"] == 12 else 5e-4
    for name, tensor in policy.engine_weights():
        assert relative_error(tensor, trained[name]) <= tolerance, name
    # The optimizer state is keyed by megatron's names and loads back (resume).
    state = megatron_trainer.state_dict()
    assert any(".linear_qkv." in key for key in state["tensors"])
    fresh = make_trainer(MegatronPolicy.from_model(tiny_moe()), case, dp=_single())
    fresh.load_state_dict(state)
    assert fresh.optimizer_steps_done == megatron_trainer.optimizer_steps_done


def test_bf16_autocast_on_cpu_is_refused_with_what_to_do() -> None:
    with pytest.raises(MilesUserError, match="precision=fp32 on CPU"):
        build_policy("megatron", tiny_moe(), precision="bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_autocast_trains_close_to_fp32_on_cuda() -> None:
    case = {"global_batch_size": 12, "loss_agg": "token_mean"}
    samples = scored_samples(12)
    fp32 = make_trainer(MegatronPolicy.from_model(tiny_moe().cuda()), case, dp=_single())
    bf16 = make_trainer(MegatronPolicy.from_model(tiny_moe().cuda()), case, dp=_single())
    bf16.cfg.precision = "bf16"
    a, b = fp32.train_step(copy.deepcopy(samples)), bf16.train_step(copy.deepcopy(samples))
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=0.05)
    assert b["train/entropy"] == pytest.approx(a["train/entropy"], rel=0.02)


def test_copy_policy_into_the_engines_model() -> None:
    model = tiny_moe()
    policy = build_policy("megatron", model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    copy_policy_into(policy, model)
    for name, tensor in policy.engine_weights():
        assert torch.equal(dict(model.named_parameters())[name], tensor)
    assert build_policy("torch", model) is model


def _single():
    from miles.distributed import SINGLE

    return SINGLE


COMMON = list(
    RESUMABLE_GRPO
)  # on CPU: bit-for-bit comparisons (the GPU form of the run is the `gpu` test below)


@pytest.mark.slow
def test_grpo_math_with_megatron_trains_resumes_and_runs_data_parallel(tmp_path: Path) -> None:
    """The main job on the megatron backend: it follows the torch backend's run, the engine's logprobs
    agree with megatron's, the checkpoint holds the synced weights, a resume repeats step 2, and two
    data-parallel processes give one process's result with identical replicas."""
    runs = tmp_path / "outputs"
    out = run_miles(tmp_path, *COMMON, "trainer.backend=megatron", run_dir=runs / "megatron")
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *COMMON, "trainer.backend=torch", run_dir=runs / "torch")
    assert out.returncode == 0, out.stderr[-3000:]
    megatron, torch_run = read_records(runs / "megatron"), read_records(runs / "torch")
    assert [r["step"] for r in megatron] == [1, 2]
    for mine, theirs in zip(megatron, torch_run, strict=True):
        assert mine["sync/checksum_ok"] == 1.0
        assert mine["mismatch/logprob_abs_diff_max"] < 1e-4  # engine (our model) vs trainer (megatron)
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-3, abs=1e-6)
        assert mine["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-3)
    assert megatron[0]["reward/mean"] == torch_run[0]["reward/mean"]  # the same first rollout

    step1 = runs / "megatron" / "checkpoints" / "step_000001"
    out = run_miles(
        tmp_path,
        *COMMON,
        "trainer.backend=megatron",
        f"trainer.resume_from={step1}",
        run_dir=runs / "resumed",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = read_records(runs / "resumed")
    for key in ("reward/mean", "train/loss", "train/grad_norm", "train/lr"):
        assert resumed[-1][key] == megatron[-1][key], key
    final = dict(iter_hf_tensors(runs / "megatron" / "checkpoints" / "step_000002"))
    again = dict(iter_hf_tensors(runs / "resumed" / "checkpoints" / "step_000002"))
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)

    out = run_miles(
        tmp_path, *COMMON, "trainer.backend=megatron", "placement.num_processes=2", run_dir=runs / "dp"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for mine, theirs in zip(read_records(runs / "dp"), megatron, strict=True):
        assert mine["sync/replicas_equal"] == 1.0
        assert mine["reward/mean"] == theirs["reward/mean"]
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_sft_with_megatron_saves_the_trained_weights(tmp_path: Path) -> None:
    out = run_miles(
        tmp_path,
        "recipe=sft_math",
        "trainer.backend=megatron",
        "trainer.max_steps=2",
        "data.train_size=32",
        "data.test_size=4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_records(tmp_path / "run")
    assert records[-1]["step"] == 2 and "eval/accuracy" in records[-1]
    start = dict(iter_hf_tensors(Path(__file__).parents[2] / "miles" / "assets" / "tiny_moe_math"))
    saved = dict(iter_hf_tensors(tmp_path / "run" / "checkpoints" / "step_000002"))
    assert saved.keys() == start.keys()
    unchanged = [k for k in saved if torch.equal(saved[k], start[k])]
    assert len(unchanged) < len(saved) // 4, f"the megatron policy was not copied back: {unchanged[:5]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grpo_math_with_megatron_on_cuda_in_bf16(tmp_path: Path) -> None:
    out = run_miles(
        tmp_path,
        "recipe=grpo_math",
        "trainer.backend=megatron",
        "trainer.precision=bf16",
        "model.device=cuda",
        "trainer.max_steps=3",
        "trainer.eval_every=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for record in read_records(tmp_path / "run"):
        assert record["sync/checksum_ok"] == 1.0
        # bf16 autocast in the trainer against the engine's float32 forward
        assert record["mismatch/logprob_abs_diff_mean"] < 0.05, record
        assert record["train/grad_norm"] > 0
