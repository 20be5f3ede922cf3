"""Online training of the draft head (`rollout.speculative=head`, trainer/draft/head_trainer.py): the loss is
the KL of every (position, step) target against a loop written out here; trained on the policy's samples the
head is accepted far more, the samples staying plain decoding's; a run checkpoints and resumes the head."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.build import build_inputs
from miles.config import OptimConfig, RolloutConfig, TrainerConfig
from miles.models.attention import VarlenAttention
from miles.models.draft_head import load_draft_head, new_draft_head
from miles.rollout import Engine
from miles.sample import Sample
from miles.trainer.draft.head_trainer import DraftHeadTrainer
from tests.support.cli import run_miles
from tests.trainer.test_draft import _config, train_between_generations

_RUN_WITH_HEAD_TRAINING = [
    "recipe=grpo_math",
    "data.train_size=64",  # not the recipe's 20000 to tokenise
    "trainer.eval_every=0",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16",
    "rollout.speculative=head",
    "rollout.spec_draft_train=true",
    "rollout.spec_draft_lr=1e-3",
    "rollout.spec_draft_train_epochs=2",
]


def test_the_loss_is_the_kl_of_every_position_and_step() -> None:
    """Against a direct loop: per sample, per response position j and step i, the head's chain from the
    policy's hidden state at j fed the true tokens, KL(policy at j + i || head) where token j + i is trained."""
    from tests.support.models import tiny_model

    model = tiny_model(False, seed=2)
    head = new_draft_head(model.args, 24, torch.float32, torch.device("cpu"), seed=5)
    with torch.no_grad():
        head.mlp.down_proj.weight.normal_(std=0.1)
    rollout = RolloutConfig(spec_draft_tokens=3, temperature=0.7, spec_draft_train=True)
    trainer = DraftHeadTrainer(head, model, TrainerConfig(micro_batch_tokens=16), rollout)
    samples = [
        Sample(prompt="", prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12], loss_mask=[1, 1, 0, 1, 1]),
        Sample(prompt="", prompt_ids=[1], response_ids=[40, 41], loss_mask=[1, 1]),
        Sample(prompt="", prompt_ids=[2, 3], response_ids=[4]),  # too short to teach anything
        Sample(prompt="", prompt_ids=[9, 9, 9, 9], response_ids=list(range(20, 34))),
    ]
    rows, skipped = trainer._usable(samples)
    assert skipped == 1
    want, count = torch.zeros(()), 0
    with torch.no_grad():
        for prompt, response, mask in rows:
            ids = torch.tensor(prompt + response[:-1])
            hidden = model.forward_packed(ids, torch.arange(len(ids)), VarlenAttention([0, len(ids)])).hidden
            features = hidden[len(prompt) - 1 :]
            for j in range(len(response)):
                state = features[j : j + 1]
                for i in range(1, 4):
                    if j + i >= len(response):
                        break
                    state = head(state, model.model.embed_tokens(torch.tensor([response[j + i - 1]])))
                    if not mask[j + i]:
                        continue
                    p = (model.lm_head(features[j + i]) / 0.7).log_softmax(-1)
                    q = (model.lm_head(state[0]) / 0.7).log_softmax(-1)
                    want += (p.exp() * (p - q)).sum()
                    count += 1
    got, got_count = torch.zeros(()), 0
    for batch in trainer._micro_batches(rows):
        picked = [rows[i] for i in batch]
        part, _, n = trainer._loss_sum(picked, trainer._features(picked))
        got, got_count = got + part.detach(), got_count + n
    assert len(trainer._micro_batches(rows)) > 1
    assert got_count == count == sum(sum(trainer._targets(r, m)) for _, r, m in rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _train(epochs: int, lr: float):  # noqa: ANN202
    cfg = _config(speculative="head", spec_draft_lr=lr, spec_draft_train_epochs=epochs, spec_draft_tokens=3)
    inputs = build_inputs(cfg)
    head = new_draft_head(inputs.model.args, 0, torch.float32, torch.device("cpu"), seed=1)
    trainer = DraftHeadTrainer(head, inputs.model, cfg.trainer, cfg.rollout)
    engine = Engine(inputs.model, inputs.tokenizer, cfg.rollout, draft_head=head)
    return cfg, inputs, trainer, engine


def test_a_trained_head_is_accepted_more_and_the_samples_do_not_change() -> None:
    """A new head trained on the policy's samples: its KL falls, the share of its drafts the policy accepts
    rises several-fold, on the prompts it saw and on others, and the samples are plain decoding's."""
    cfg, inputs, trainer, engine = _train(epochs=30, lr=3e-3)
    run = train_between_generations(cfg, inputs, engine, trainer.train_step)
    expected, before, after, metrics = run.expected, run.before, run.after, run.metrics
    accepted_before, accepted_after, accepted_unseen = run.accepted
    for got in (before, after):
        assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert metrics["draft/loss_last_epoch"] < 0.5 * metrics["draft/loss"]
    assert metrics["draft/skipped_samples"] == 0 and metrics["draft/lr"] == 3e-3
    assert 0 <= metrics["draft/top1_agreement"] <= 1 and metrics["draft/grad_norm"] > 0
    assert accepted_after > 3 * accepted_before and accepted_after > 0.3
    assert accepted_unseen > 2 * accepted_before


def test_a_bf16_head_trains_through_float32_masters() -> None:
    """A 16-bit head keeps float32 masters: a small update that bf16 rounding would drop still moves them,
    and the head holds their rounding."""
    from tests.support.models import tiny_model

    model = tiny_model(False, seed=2).to(torch.bfloat16)
    head = new_draft_head(model.args, 0, torch.bfloat16, torch.device("cpu"), seed=5)
    rollout = RolloutConfig(spec_draft_tokens=2, spec_draft_train=True, spec_draft_lr=1e-5)
    trainer = DraftHeadTrainer(head, model, TrainerConfig(), rollout)
    assert trainer.masters is not None
    before = [m.clone() for m in trainer.masters.masters]
    sample = Sample(prompt="", prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12])
    trainer.train_step([sample])
    moved = [not torch.equal(a, b) for a, b in zip(before, trainer.masters.masters)]
    assert sum(moved) >= len(moved) - 2  # (a norm's weight may see no gradient)
    for param, master in zip(head.parameters(), trainer.masters.masters):
        assert torch.equal(param, master.to(torch.bfloat16))


@pytest.mark.slow
def test_a_run_trains_checkpoints_and_resumes_its_head(tmp_path: Path) -> None:
    """`miles train` with a head trained online logs the draft metrics, writes the head into each checkpoint
    (`step_N/draft_head/`, loadable as rollout.spec_head) with its optimizer state, and a run resumed from
    step 1 trains the same head at step 2 as the uninterrupted run."""
    common = [*_RUN_WITH_HEAD_TRAINING, "trainer.max_steps=2", "trainer.save_every=1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    out = run_miles(tmp_path, *common, run_dir=whole)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "draft/loss" in r]
    assert len(trained) == 2 and all(
        r["time/draft_train"] > 0 and r["rollout/spec_steps"] > 0 for r in trained
    )
    step1 = whole / "checkpoints" / "step_000001"
    assert (step1 / "resume" / "draft_trainer_state.safetensors").is_file()
    out = run_miles(tmp_path, *common, f"trainer.resume_from={step1}", run_dir=resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "holds no trained draft" not in out.stdout + out.stderr
    mine = json.loads((resumed / "metrics.jsonl").read_text().splitlines()[-1])
    theirs = trained[-1]
    assert mine["step"] == theirs["step"] == 2
    for key in ("draft/loss", "draft/grad_norm", "rollout/spec_accepted_tokens"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    cpu = torch.device("cpu")
    heads = [
        load_draft_head(run / "checkpoints" / "step_000002" / "draft_head", torch.float32, cpu)
        for run in (whole, resumed)
    ]
    first = load_draft_head(step1 / "draft_head", torch.float32, cpu)
    assert not torch.equal(first.fc.weight, heads[0].fc.weight)
    torch.testing.assert_close(heads[0].state_dict(), heads[1].state_dict())
    out = run_miles(  # a trained head drafts for a later run
        tmp_path,
        *_RUN_WITH_HEAD_TRAINING[:-3],
        "trainer.max_steps=1",
        f"rollout.spec_head={whole / 'checkpoints' / 'step_000002' / 'draft_head'}",
        run_dir=tmp_path / "later",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "untrained draft head" not in out.stdout + out.stderr


def test_two_processes_train_the_head_as_one(tmp_path: Path) -> None:
    """`placement.num_processes=2`: the ranks sum their gradients, so the head's first update is one
    process's on the whole batch."""
    common = [*_RUN_WITH_HEAD_TRAINING, "trainer.max_steps=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    for run, extra in ((one, []), (two, ["placement.num_processes=2"])):
        out = run_miles(tmp_path, *common, *extra, run_dir=run)
        assert out.returncode == 0, out.stderr[-3000:]
    single, double = (json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (one, two))
    assert single["reward/mean"] == double["reward/mean"]
    for key in ("draft/loss", "draft/grad_norm", "draft/top1_agreement"):
        assert double[key] == pytest.approx(single[key], rel=1e-4), key
    a, b = (
        load_draft_head(
            run / "checkpoints" / "step_000001" / "draft_head", torch.float32, torch.device("cpu")
        )
        for run in (one, two)
    )
    diff = max((x - y).abs().max() for x, y in zip(a.parameters(), b.parameters()))
    assert diff < 1e-4, diff


def test_head_training_checks_its_settings() -> None:
    from miles.config.validate import check_draft_training
    from miles.errors import MilesUserError

    cfg = _config(speculative="head")
    check_draft_training(cfg)  # a head needs nothing to start from
    with pytest.raises(MilesUserError, match="speculative=head"):
        check_draft_training(replace(cfg, rollout=replace(cfg.rollout, speculative="ngram")))
    with pytest.raises(ValueError, match="spec_draft_lr"):
        DraftHeadTrainer(
            new_draft_head(build_inputs(cfg).model.args, 0, torch.float32, torch.device("cpu"), 0),
            build_inputs(cfg).model,
            cfg.trainer,
            replace(cfg.rollout, spec_draft_lr=0.0),
        )


def test_training_the_head_leaves_the_policy_untouched() -> None:
    """The head learns through the policy's embedding and LM head, which get no gradient (the policy's own
    update would add it in) and keep their values."""
    from tests.support.models import tiny_model

    model = tiny_model(False, seed=2).train()
    head = new_draft_head(model.args, 0, torch.float32, torch.device("cpu"), seed=5)
    rollout = RolloutConfig(spec_draft_tokens=2, spec_draft_train=True, spec_draft_lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    DraftHeadTrainer(head, model, TrainerConfig(), rollout).train_step(
        [Sample(prompt="", prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12])]
    )
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training  # its mode is given back


def _head_trainer(lr: float, trainer: TrainerConfig | None = None) -> DraftHeadTrainer:
    from tests.support.models import tiny_model

    model = tiny_model(False, seed=2)
    head = new_draft_head(model.args, 24, torch.float32, torch.device("cpu"), seed=5)
    rollout = RolloutConfig(spec_draft_tokens=2, spec_draft_train=True, spec_draft_lr=lr)
    return DraftHeadTrainer(head, model, trainer or TrainerConfig(), rollout)


_SAMPLE = Sample(prompt="", prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12])


def test_a_resumed_head_trains_with_this_runs_optimizer_settings() -> None:
    """As DraftTrainer: the checkpoint gives AdamW's moments; rollout.spec_draft_lr and the AdamW settings
    changed for the resume apply (and `draft/lr` reports them)."""
    first = _head_trainer(1e-3)
    first.train_step([_SAMPLE])
    state = first.state_dict()
    optim = OptimConfig(weight_decay=0.1, betas=[0.5, 0.9], eps=1e-3)
    resumed = _head_trainer(1e-5, TrainerConfig(optim=optim))
    resumed.load_state_dict(state)
    for group in resumed.optimizer.param_groups:
        assert group["lr"] == 1e-5 and tuple(group["betas"]) == (0.5, 0.9) and group["eps"] == 1e-3
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.1, 0.0]
    saved = resumed.state_dict()["tensors"]
    assert saved.keys() == state["tensors"].keys()
    assert all(torch.equal(saved[k], state["tensors"][k]) for k in saved)
    assert resumed.train_step([_SAMPLE])["draft/lr"] == 1e-5


def test_a_non_finite_gradient_skips_the_head_step() -> None:
    """As PolicyTrainer: a NaN gradient norm skips the update (counted in `draft/skipped_steps`) instead of
    writing NaN into the head and its AdamW moments."""
    trainer = _head_trainer(1e-3)
    before = [p.detach().clone() for p in trainer.head.parameters()]
    hook = trainer.head.fc.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    metrics = trainer.train_step([_SAMPLE])
    assert metrics["draft/skipped_steps"] == 1 and math.isnan(metrics["draft/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.head.parameters()))
    assert not trainer.optimizer.state and all(p.grad is None for p in trainer.params)
    hook.remove()
    assert trainer.train_step([_SAMPLE])["draft/skipped_steps"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.head.parameters())
    assert not torch.equal(before[0], next(trainer.head.parameters()))
