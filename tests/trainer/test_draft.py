"""Online training of the draft model (`rollout.spec_draft_train`, trainer/draft/model_trainer.py): trained on the
policy's samples, the draft proposes what the policy samples more often, while the samples stay plain
decoding's; a run checkpoints and resumes the trained draft."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.build import build_inputs
from miles.config import MilesConfig
from miles.config.validate import check_draft_training
from miles.errors import MilesUserError
from miles.model_io import load_model
from miles.rollout import Engine, SamplingParams
from miles.sample import Sample, SampleStatus
from miles.trainer.draft.model_trainer import DraftTrainer
from tests.support.cli import run_miles

_RUN_WITH_DRAFT_TRAINING = [
    "recipe=grpo_math",
    "data.train_size=64",  # not the recipe's 20000 to tokenise
    "trainer.eval_every=0",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16",
    "rollout.speculative=draft",
    "rollout.spec_draft_model=init:qwen3:tiny",
    "rollout.spec_draft_train=true",
    "rollout.spec_draft_lr=1e-3",
    "rollout.spec_draft_train_epochs=2",
]
"""A small `miles train` run that trains a random draft (the last three are the draft-training settings)."""


def _config(**rollout: object) -> MilesConfig:
    cfg = MilesConfig()
    cfg.model.path = "builtin:tiny_moe_math"
    cfg.model.device = "cpu"
    cfg.data.train_size, cfg.data.test_size = 64, 8
    settings: dict[str, object] = dict(
        speculative="draft", spec_draft_train=True, max_new_tokens=24, kv_cache_bytes=4 * 1024 * 1024
    )
    cfg.rollout = replace(cfg.rollout, **{**settings, **rollout})  # type: ignore[arg-type]
    return cfg


def _accepted(engine: Engine) -> float:
    metrics = engine.metrics()
    return metrics["rollout/spec_accepted_tokens"] / metrics["rollout/spec_proposed_tokens"]


@dataclass
class TrainedBetween:
    expected: list[Sample]
    """Plain decoding's samples of the prompts."""
    before: list[Sample]
    after: list[Sample]
    metrics: dict[str, float]
    accepted: tuple[float, float, float]
    """Shares of drafts accepted before training, after it on the same prompts, and on others."""


def train_between_generations(
    cfg: MilesConfig, inputs: Any, engine: Engine, train: Callable[[list[Sample]], dict[str, float]]
) -> TrainedBetween:
    """Generate 8 prompts x n = 4 at temperature 1, train the draft on those samples, generate them again
    and 8 other prompts, against plain decoding's samples of the first 8."""
    plain = Engine(inputs.model, inputs.tokenizer, replace(cfg.rollout, speculative="off"))
    prompts = inputs.train_prompts[:8]
    params = SamplingParams(
        n=4, temperature=1.0, max_new_tokens=24, stop_token_ids=inputs.stop_token_ids, seed=11
    )
    expected = plain.generate(prompts, params)
    before = engine.generate(prompts, params)
    accepted_before = _accepted(engine)
    metrics = train(before)
    engine.draft_weights_changed()
    after = engine.generate(prompts, params)
    accepted_after = _accepted(engine)
    engine.generate(inputs.train_prompts[8:16], params)  # prompts it was not trained on
    return TrainedBetween(
        expected, before, after, metrics, (accepted_before, accepted_after, _accepted(engine))
    )


def test_a_trained_draft_is_accepted_more_and_the_samples_do_not_change() -> None:
    """A random draft trained on the policy's samples: its NLL of them falls, the share of its drafts the
    policy accepts on the same prompts rises several-fold, and the samples are plain decoding's throughout."""
    cfg = _config(spec_draft_lr=3e-3, spec_draft_train_epochs=30)
    inputs = build_inputs(cfg)
    draft = load_model("init:qwen3:tiny", device="cpu", seed=1).model
    trainer = DraftTrainer(draft, inputs.model.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm)
    engine = Engine(inputs.model, inputs.tokenizer, cfg.rollout, draft_model=draft)
    run = train_between_generations(cfg, inputs, engine, trainer.train_step)
    expected, before, after, metrics = run.expected, run.before, run.after, run.metrics
    accepted_before, accepted_after, accepted_unseen = run.accepted

    for samples in (before, after):
        assert [s.response_ids for s in samples] == [s.response_ids for s in expected]
        assert [s.status for s in samples] == [s.status for s in expected]
    assert metrics["draft/loss"] == pytest.approx(torch.log(torch.tensor(101.0)).item(), abs=0.3)  # random
    assert metrics["draft/loss_last_epoch"] < 0.6 * metrics["draft/loss"]
    assert accepted_before < 0.1
    # Measured: 0.002 before, 0.38 after on the same prompts, 0.13 on others.
    assert accepted_after > 0.2, (accepted_before, accepted_after)
    assert accepted_unseen > 10 * accepted_before, (accepted_before, accepted_unseen)
    assert engine.draft_model is draft  # trained in place: the engine drafts with the same module


def test_draft_training_takes_only_samples_it_can_learn_from() -> None:
    cfg = _config()
    draft = load_model("init:qwen3:tiny", device="cpu", seed=1).model
    trainer = DraftTrainer(draft, draft.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm)
    ok = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], loss_mask=[1, 0, 1], group_id=3, index=1)
    aborted = Sample(prompt_ids=[5], response_ids=[7], status=SampleStatus.ABORTED)
    empty = Sample(prompt_ids=[5], response_ids=[])
    context = draft.args.context_length
    no_room = Sample(prompt_ids=[5] * (context + 1), response_ids=[7, 8])
    long = Sample(prompt_ids=[5] * (context - 2), response_ids=[7, 8, 9, 10, 11])  # 3 response tokens fit
    unmasked = Sample(prompt_ids=[5], response_ids=[7, 8])
    kept, cut = trainer.training_samples([ok, aborted, empty, no_room, long, unmasked])
    assert [(s.response_ids, s.loss_mask, s.group_id, s.index) for s in kept] == [
        ([7, 8, 9], [1, 0, 1], 3, 1),
        ([7, 8, 9], [1, 1, 1], 0, 0),
        ([7, 8], [1, 1], 0, 0),
    ]
    assert cut == 1 and len(kept[1].prompt_ids) + len(kept[1].response_ids) - 1 == context
    metrics = trainer.train_step([aborted, empty])
    assert metrics == {"draft/skipped_samples": 2.0, "draft/truncated_samples": 0.0}  # no optimizer step
    # A draft with a smaller (padded) vocabulary: ids it lacks are fed as its last and not trained on.
    smaller = DraftTrainer(draft, draft.args.vocab_size + 20, cfg.trainer, cfg.rollout, cfg.algorithm)
    beyond = draft.args.vocab_size + 5
    (clamped,), _ = smaller.training_samples([Sample(prompt_ids=[beyond, 5], response_ids=[7, beyond, 9])])
    last = draft.args.vocab_size - 1
    assert clamped.prompt_ids == [last, 5] and clamped.response_ids == [7, last, 9]
    assert clamped.loss_mask == [1, 0, 1]


def test_draft_training_settings_are_checked() -> None:
    cfg = _config()
    draft = load_model("init:qwen3:tiny", device="cpu", seed=1).model
    with pytest.raises(ValueError, match="vocabulary"):
        DraftTrainer(draft, draft.args.vocab_size - 1, cfg.trainer, cfg.rollout, cfg.algorithm)
    with pytest.raises(ValueError, match="spec_draft_lr"):
        DraftTrainer(draft, 101, cfg.trainer, replace(cfg.rollout, spec_draft_lr=float("nan")), cfg.algorithm)
    with pytest.raises(ValueError, match="spec_draft_train_epochs"):
        DraftTrainer(draft, 101, cfg.trainer, replace(cfg.rollout, spec_draft_train_epochs=0), cfg.algorithm)
    cfg.rollout = replace(cfg.rollout, spec_draft_model="init:qwen3:tiny")
    check_draft_training(cfg)
    for rollout in (replace(cfg.rollout, speculative="ngram"), replace(cfg.rollout, deterministic=True)):
        with pytest.raises(MilesUserError, match="speculative=draft"):
            check_draft_training(replace(cfg, rollout=rollout))
    for rollout, message in (
        (replace(cfg.rollout, spec_draft_model=None), "set rollout.spec_draft_model"),
        (replace(cfg.rollout, spec_draft_model="x", spec_draft_lr=float("inf")), "positive and finite"),
        (replace(cfg.rollout, spec_draft_model="x", spec_draft_train_epochs=0), "must be >= 1"),
    ):
        with pytest.raises(MilesUserError, match=message):
            check_draft_training(replace(cfg, rollout=rollout))


@pytest.mark.slow
def test_a_run_checkpoints_its_trained_draft_and_resumes_it(tmp_path: Path) -> None:
    """`miles train` with spec_draft_train logs draft/* metrics, writes the draft into each checkpoint
    (`step_N/draft/`, loadable as `rollout.spec_draft_model`), and a run resumed from step 1 trains the same
    draft at step 2 as the uninterrupted run."""
    from safetensors.torch import load_file

    common = [*_RUN_WITH_DRAFT_TRAINING, "trainer.max_steps=2", "trainer.save_every=1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    out = run_miles(tmp_path, *common, run_dir=whole)
    assert out.returncode == 0, out.stderr[-3000:]
    step1 = whole / "checkpoints" / "step_000001"
    assert (step1 / "draft" / "model.safetensors").is_file()
    assert (step1 / "resume" / "draft_trainer_state.safetensors").is_file()
    out = run_miles(tmp_path, *common, f"trainer.resume_from={step1}", run_dir=resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "holds no trained draft" not in out.stdout + out.stderr

    def last(run: Path) -> dict:
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])

    mine, theirs = last(resumed), last(whole)
    assert mine["step"] == theirs["step"] == 2
    for key in ("draft/loss", "draft/grad_norm", "rollout/spec_accepted_tokens", "reward/mean", "train/loss"):
        assert mine[key] == theirs[key], key
    assert theirs["time/draft_train"] > 0
    a = load_file(str(whole / "checkpoints" / "step_000002" / "draft" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_000002" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The trained draft is a checkpoint of its own: a later run drafts with it.
    out = run_miles(
        tmp_path,
        *_RUN_WITH_DRAFT_TRAINING[:-3],
        "trainer.max_steps=1",
        "trainer.save_every=0",
        f"rollout.spec_draft_model={whole / 'checkpoints' / 'step_000002' / 'draft'}",
        run_dir=tmp_path / "later",
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_two_processes_train_the_draft_as_one(tmp_path: Path) -> None:
    """`placement.num_processes=2`: each rank trains the draft on its half of the samples with the gradients
    summed across ranks, so the draft's first update is one process's on the whole batch."""
    from safetensors.torch import load_file

    common = [*_RUN_WITH_DRAFT_TRAINING, "trainer.max_steps=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    out = run_miles(tmp_path, *common, run_dir=one)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_miles(tmp_path, *common, "placement.num_processes=2", run_dir=two)
    assert out.returncode == 0, out.stderr[-3000:]
    single, double = (json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (one, two))
    assert single["reward/mean"] == double["reward/mean"]  # the same samples
    for key in ("draft/loss", "draft/grad_norm"):
        assert double[key] == pytest.approx(single[key], rel=1e-4), key
    a, b = (
        load_file(str(run / "checkpoints" / "step_000001" / "draft" / "model.safetensors"))
        for run in (one, two)
    )
    # Measured 6.5e-6 at most: AdamW's first step moves a weight by ~lr whatever its gradient's size, so
    # summation-order rounding in a near-zero gradient shows at ~lr times its relative error.
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diff.max() < 1e-4, diff.max()


def test_a_draft_equal_to_the_policy_gets_no_gradient_at_the_rollout_temperature() -> None:
    """The engine draws a draft token from the draft's logits / T (the request's own sampling settings,
    rollout/draft_draws.py), so the draft fits the policy when softmax(z_draft / T) matches what the policy
    samples, softmax(z_policy / T): its NLL must be taken at the rollout's temperature. A draft that is an
    exact copy of the policy, trained on responses whose tokens follow the policy's distribution at T = 0.5,
    then gets almost no gradient (the counts' rounding: 0.026). Trained at temperature 1 (as before), it was
    pushed off the policy: grad norm 0.27."""
    temperature = 0.5
    cfg = _config(temperature=temperature, spec_draft_lr=1e-9, spec_draft_train_epochs=1)
    cfg.trainer = replace(cfg.trainer, optim=replace(cfg.trainer.optim, grad_clip=0.0))
    draft = load_model("init:qwen3:tiny", device="cpu", seed=1).model
    prompt = [5, 6, 7]
    with torch.no_grad():
        policy = torch.softmax(draft(torch.tensor([prompt]))[0, -1].double() / temperature, -1)
    counts = torch.round(policy * 4000).long().tolist()
    samples = [Sample(prompt_ids=prompt, response_ids=[t]) for t, c in enumerate(counts) for _ in range(c)]
    trainer = DraftTrainer(draft, draft.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm)
    metrics = trainer.train_step(samples)
    assert metrics["draft/grad_norm"] < 0.08, metrics["draft/grad_norm"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_draft_s_gradient_is_its_masked_nll_at_the_rollout_temperature(temperature: float) -> None:
    """The draft's gradient is the token mean, over the unmasked response tokens, of -log softmax(z / T) of a
    plain forward (T = 1 for a greedy rollout), written out by hand."""
    import torch.nn.functional as F

    cfg = _config(temperature=temperature, spec_draft_lr=1e-9, spec_draft_train_epochs=1)
    cfg.trainer = replace(cfg.trainer, optim=replace(cfg.trainer.optim, grad_clip=0.0))
    draft = load_model("init:qwen3:tiny", device="cpu", seed=1).model
    samples = [
        Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], loss_mask=[1, 0, 1]),
        Sample(prompt_ids=[10], response_ids=[11, 12]),
        Sample(prompt_ids=[13, 14, 15], response_ids=[16]),
    ]
    scale = temperature if temperature > 0 else 1.0
    total, count = torch.zeros(()), 0
    for s in samples:
        logits = draft(torch.tensor([s.prompt_ids + s.response_ids]))[0].float() / scale
        p = len(s.prompt_ids)
        nll = F.cross_entropy(
            logits[p - 1 : p - 1 + len(s.response_ids)], torch.tensor(s.response_ids), reduction="none"
        )
        mask = torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.float32)
        total, count = total + (nll * mask).sum(), count + int(mask.sum())
    (total / count).backward()
    expected = {name: p.grad.clone() for name, p in draft.named_parameters()}
    draft.zero_grad(set_to_none=True)
    trainer = DraftTrainer(draft, draft.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm)
    kept: dict[str, torch.Tensor] = {}
    step = trainer.trainer.optimizer.step

    def keep(*args: Any, **kwargs: Any) -> Any:
        for name, p in draft.named_parameters():
            kept[name] = p.grad.clone()
        return step(*args, **kwargs)

    trainer.trainer.optimizer.step = keep  # type: ignore[method-assign]
    metrics = trainer.train_step(samples)
    assert metrics["draft/loss"] == pytest.approx((total / count).item(), rel=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(kept[name], grad, atol=1e-6, rtol=1e-4, msg=name)
