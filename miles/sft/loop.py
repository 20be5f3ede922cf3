"""Supervised fine-tuning on reference solutions (`recipe=sft_math` makes grpo_math's starting checkpoint).

Runs `trainer.sft_epochs` passes over the data, at most `trainer.max_steps` optimizer steps.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from miles.build import build_engine, build_inputs, build_rewards, build_trainer
from miles.config import MilesConfig
from miles.data import PromptFormatter
from miles.distributed import SINGLE, DataParallel, reduce_metrics
from miles.errors import MilesUserError
from miles.evaluate import evaluate
from miles.resume import save_checkpoint
from miles.sft.examples import end_of_turn_stops, fit_context, sft_samples
from miles.tracking import Tracker, redact


def sft_batches(count: int, batch: int, shuffle: bool, seed: int) -> Iterator[list[int]]:
    """Endless batches of `batch` sample indices: pass after pass over the data, each pass shuffled when
    `shuffle` (data.shuffle, as the RL loop's prompts); a batch may run on into the next pass."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < batch:
            fresh = list(range(count))
            if shuffle:
                rng.shuffle(fresh)
            order += fresh
        yield order[:batch]
        order = order[batch:]


def run_sft(cfg: MilesConfig, run_dir: Path, dp: DataParallel = SINGLE) -> dict[str, float]:
    """Supervised steps on the dataset's reference answers; with `dp` each rank trains on its share of every
    batch (gradients summed across ranks) and rank 0 writes the run folder."""
    from miles.trainer.backends import copy_policy_into

    if cfg.trainer.resume_from:
        raise MilesUserError(
            "trainer.resume_from resumes RL runs; an SFT run starts from a checkpoint's weights with "
            "model.path=<checkpoints/step_N>"
        )
    inputs = build_inputs(cfg, dp)
    model, tokenizer, eos, test_prompts = (
        inputs.model,
        inputs.tokenizer,
        inputs.stop_token_ids,
        inputs.test_prompts,
    )
    formatter = PromptFormatter(tokenizer, cfg.data, cfg.model.chat_template)
    data, fitted = fit_context(
        sft_samples(inputs.train_prompts, tokenizer, tokenizer.eos_token_id, formatter),
        model.args.context_length,
    )
    if not data:
        raise MilesUserError("no SFT example fits the model's context")
    eos = end_of_turn_stops(formatter, model.args, eos)

    batch = cfg.trainer.sft_batch_size
    steps = math.ceil(len(data) * cfg.trainer.sft_epochs / batch)
    if cfg.trainer.max_steps > 0:
        steps = min(steps, cfg.trainer.max_steps)
    trainer = build_trainer(
        cfg, model, dp, temperature=1.0, total_optimizer_steps=steps, routing_replay=False
    )
    policy = trainer.model
    tracker = Tracker(run_dir, cfg.logging, redact(asdict(cfg)), cfg.recipe, steps) if dp.is_main else None
    batches = sft_batches(len(data), batch, cfg.data.shuffle, cfg.data.seed)
    last: dict[str, float] = {}
    engine, rewards = None, None
    # As the RL loop: at the start, every eval_every steps and at the end; never with eval_every=0.
    eval_on = bool(cfg.trainer.eval_every and test_prompts)

    def run_eval(step: int) -> dict[str, float]:
        nonlocal engine, rewards
        copy_policy_into(policy, model)
        if engine is None:
            # its KV pool leaves the updates' gradients (and AdamW's moments before the first) free
            engine = build_engine(cfg, model, tokenizer, trainer.memory_reserve_bytes())
            rewards = build_rewards(cfg, engine)  # a judge reward may drive the engine
        engine.update_weights([], step)
        eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
        prompts = dp.shard(test_prompts)
        eval_metrics, _ = evaluate(
            engine.generate, rewards, prompts, eval_tokens, eos, list(cfg.rollout.stop)
        )
        return reduce_metrics(dp, eval_metrics, eval_metrics.get("eval/num_samples", len(prompts)))

    try:
        # What loading the data dropped goes into the run's first record, as in the RL loop: step 0's when
        # the start is evaluated, else step 1's.
        unreported = {**inputs.dropped_metrics(), **fitted}
        if eval_on:
            start_metrics = run_eval(0)
            if tracker is not None:
                tracker.log_step(0, {**start_metrics, **unreported})
            unreported = {}
        for step in range(1, steps + 1):
            start = time.perf_counter()
            chunk = [data[i] for i in next(batches)]
            metrics = trainer.sft_step(dp.shard(chunk))
            metrics["time/train"] = metrics["time/step"] = time.perf_counter() - start
            is_last = step == steps
            saving = (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or (
                is_last and cfg.trainer.save_final
            )
            if eval_on and (step % cfg.trainer.eval_every == 0 or is_last):
                metrics.update(run_eval(step))  # (copies the trainer's weights into `model` too)
            elif saving:
                copy_policy_into(policy, model)
            if saving and dp.is_main:
                save_checkpoint(model, tokenizer, run_dir, step, keep_last=cfg.trainer.keep_last)
            metrics.update(unreported)
            unreported = {}
            if tracker is not None:
                tracker.log_step(step, metrics)
            last = metrics
    finally:
        if tracker is not None:
            tracker.close()
        if rewards is not None:
            rewards.close()
    return last
