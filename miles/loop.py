"""The RL loop on the embedded placement: one process, one device, the engine and trainer sharing weights.

step = rollout (engine) -> rewards -> advantages -> train (with mismatch metrics) -> weight sync (+checksum)
-> eval / checkpoint -> metrics.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from miles import plugins
from miles.config import MilesConfig
from miles.data import PromptFormatter, PromptLoader, load_rows, to_samples
from miles.errors import MilesUserError
from miles.evaluate import evaluate
from miles.model_io import load_model
from miles.resume import config_changes, find_checkpoint, read_run_state, restore_rng, write_run_state
from miles.sample import Sample, SampleStatus
from miles.tracking import Tracker, redact
from miles.utilization import busy_meter

log = logging.getLogger("miles.loop")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_cpu_threads(threads: int) -> None:
    # On 2 shared cores a second intra-op thread makes tiny-model kernels tens of times slower.
    if threads > 0:
        torch.set_num_threads(threads)


def stop_ids(tokenizer: object, model_eos: list[int]) -> list[int]:
    ids = set(model_eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return sorted(ids)


def rollout_metrics(samples: list[Sample], max_new_tokens: int) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    rewards = [s.reward for s in samples]
    return {
        "response_length/mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples)
        / max(len(samples), 1),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/aborted": float(sum(s.status == SampleStatus.ABORTED for s in samples)),
    }


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: object,
    run_dir: Path,
    step: int,
    write_extra: Callable[[Path], None] | None = None,
    keep_last: int = 0,
) -> Path:
    """Write `checkpoints/step_N/` (atomically); with `keep_last` > 0, then remove all but the newest
    `keep_last` step folders."""
    from miles.models import save_pretrained

    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    saved = save_pretrained(model, folder, tokenizer=tokenizer, write_extra=write_extra)
    if keep_last > 0:
        steps = sorted(
            (p for p in folder.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),  # by number: names past 6 digits sort wrongly as text
        )
        for old in steps[:-keep_last]:
            if old != saved:
                shutil.rmtree(old, ignore_errors=True)
    return saved


@dataclass
class RunInputs:
    """What every job starts from: the model and tokenizer, and the tokenised prompts."""

    model: Any  # CausalLM
    tokenizer: Any
    train_prompts: list[Sample]
    test_prompts: list[Sample]
    dropped_prompts: int
    stop_token_ids: list[int]


def prepare_inputs(cfg: MilesConfig) -> RunInputs:
    seed_everything(cfg.trainer.seed)
    set_cpu_threads(cfg.placement.cpu_threads)
    loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed)
    formatter = PromptFormatter(loaded.tokenizer, cfg.data, cfg.model.chat_template)
    train_rows, test_rows = load_rows(cfg.data)
    train_prompts, dropped = to_samples(train_rows, formatter, cfg.data.max_prompt_length)
    test_prompts, _ = to_samples(test_rows, formatter, cfg.data.max_prompt_length)
    eos = stop_ids(loaded.tokenizer, loaded.model.args.eos_token_ids)
    return RunInputs(loaded.model, loaded.tokenizer, train_prompts, test_prompts, dropped, eos)


def resume_run(
    cfg: MilesConfig,
    run_dir: Path,
    model: Any,
    engine: Any,
    trainer: Any,
    loader: PromptLoader,
    tracker: Tracker,
) -> int:
    """Load a checkpoint's weights, optimizer, schedule, loader position and RNG states into the run, and
    the interrupted run's metrics up to it into this run's; returns the step it finished."""
    from miles.models.checkpoint import iter_hf_tensors, load_state_into

    folder = find_checkpoint(cfg.trainer.resume_from, run_dir, cfg.recipe)
    state = read_run_state(folder)
    changes = config_changes(state.config, redact(asdict(cfg)))
    if changes:
        log.warning(
            "resuming %s with %d setting(s) changed, so it will not repeat the first run: %s",
            folder,
            len(changes),
            "; ".join(changes[:10]),
        )
    max_steps = cfg.trainer.max_steps
    with torch.no_grad():
        load_state_into(model, iter_hf_tensors(folder))
    trainer.load_state_dict(state.trainer)
    if max_steps != state.max_steps:
        # A longer (or shorter) run: the cosine schedule is re-sized to it from the current position.
        log.info("trainer.max_steps %d -> %d: the LR schedule is re-sized", state.max_steps, max_steps)
        trainer.total_optimizer_steps = None
    loader.load_state_dict(state.loader)
    if state.engine:
        engine.load_state_dict(state.engine)
    metrics = folder.parent.parent / "metrics.jsonl"  # checkpoints/step_N/ -> the run folder
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        tracker.carry_over([r for r in records if r.get("step", state.step + 1) <= state.step])
    restore_rng(state)
    log.info("resumed from %s (step %d)", folder, state.step)
    return state.step


def run_rl(cfg: MilesConfig, run_dir: Path) -> dict[str, float]:
    from miles.rewards import RewardRunner
    from miles.rollout import Engine, SamplingParams
    from miles.rollout.multiturn import MultiTurnRollout
    from miles.trainer import TorchTrainer
    from miles.trainer.algorithms import compute_advantages
    from miles.weight_sync import InProcessWeightSync

    inputs = prepare_inputs(cfg)
    model, tokenizer, eos = inputs.model, inputs.tokenizer, inputs.stop_token_ids
    train_prompts, test_prompts, dropped = inputs.train_prompts, inputs.test_prompts, inputs.dropped_prompts
    loader = PromptLoader(train_prompts, cfg.rollout.rollout_batch_size, cfg.data.shuffle, cfg.data.seed)

    ref_model = None
    if cfg.algorithm.kl_coef > 0:
        ref_model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed).model
        ref_model.requires_grad_(False)
    engine = Engine(model, tokenizer, cfg.rollout)
    generate, multiturn = engine.generate, None
    if cfg.rollout.generate_fn:
        if cfg.trainer.routing_replay:
            raise MilesUserError(
                "trainer.routing_replay needs each sample's recorded experts, which a multi-turn sample "
                "(rollout.generate_fn) does not carry; turn one of them off"
            )
        spec = plugins.normalize(cfg.rollout.generate_fn, "rollout.generate_fn")
        fn = plugins.load(spec, "rollout.generate_fn")
        multiturn = MultiTurnRollout(engine, fn, cfg.rollout.generate_timeout_s)
        generate = multiturn.generate
    trainer = TorchTrainer(
        model, cfg.trainer, cfg.algorithm, temperature=cfg.rollout.temperature, ref_model=ref_model
    )
    sync = InProcessWeightSync(model, engine)
    rewards = RewardRunner(cfg.reward, engine=engine)
    params = SamplingParams(
        n=cfg.rollout.n_samples_per_prompt,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        min_p=cfg.rollout.min_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=eos,
        stop=list(cfg.rollout.stop),
        return_routing=cfg.rollout.record_routing,
    )
    eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
    tracker = Tracker(run_dir, cfg.logging, redact(asdict(cfg)), cfg.recipe, cfg.trainer.max_steps, tokenizer)
    last: dict[str, float] = {}
    busy = busy_meter(model.device)  # util/gpu_busy_frac on CUDA, util/cpu_busy_frac on CPU
    first_step = 1
    if cfg.trainer.resume_from:
        first_step = resume_run(cfg, run_dir, model, engine, trainer, loader, tracker) + 1
        if first_step > cfg.trainer.max_steps:
            raise MilesUserError(
                f"the checkpoint already finished step {first_step - 1} of trainer.max_steps="
                f"{cfg.trainer.max_steps}; raise trainer.max_steps to train further"
            )
        result = sync.sync(version=first_step - 1)  # the engine serves the checkpoint's weights from here on
        if not result.checksum_ok:
            raise RuntimeError(f"weight sync checksum mismatch after resuming: {result.mismatched[:5]}")

    def write_resume_state(step: int) -> Callable[[Path], None]:
        return lambda folder: write_run_state(
            folder, step, redact(asdict(cfg)), trainer.state_dict(), loader.state_dict(), engine.state_dict()
        )

    def run_eval() -> dict[str, float]:
        metrics, _ = evaluate(generate, rewards, test_prompts, eval_tokens, eos, list(cfg.rollout.stop))
        # The next step starts as it would after a resume: from an empty radix cache (the eval's prompts
        # would change its bf16 prefill rounding on a GPU), and with counters that are its own.
        engine.flush_cache()
        engine.metrics()
        if multiturn is not None:
            metrics["eval/generate_errors"] = multiturn.metrics()["rollout/generate_errors"]
        return metrics

    try:
        if cfg.trainer.eval_every and test_prompts and first_step == 1:
            tracker.log_step(0, {**run_eval(), "data/dropped_prompts": float(dropped)})
        for step in range(first_step, cfg.trainer.max_steps + 1):
            step_start = time.perf_counter()
            if busy is not None:
                busy[1].start()
            params.seed = cfg.rollout.seed * 1_000_003 + step
            t = time.perf_counter()
            batch = [replace(p, group_id=i) for i, p in enumerate(loader.next_batch())]
            samples = generate(batch, params)
            metrics: dict[str, float] = {"time/rollout": time.perf_counter() - t}
            metrics.update(engine.metrics())
            if multiturn is not None:
                metrics.update(multiturn.metrics())

            t = time.perf_counter()
            metrics.update(rewards.score(samples))
            metrics["time/reward"] = time.perf_counter() - t
            metrics.update(rollout_metrics(samples, cfg.rollout.max_new_tokens))
            # An aborted request (engine error, failed generate plugin) has no response: it costs its sample,
            # never the step, and stays out of its group's advantages (its reward 0 would lift the others').
            trainable = [s for s in samples if s.response_ids and s.status != SampleStatus.ABORTED]
            metrics.update(compute_advantages(trainable, cfg.algorithm))

            t = time.perf_counter()
            metrics["train/dropped_samples"] = float(len(samples) - len(trainable))
            if trainable:
                metrics.update(trainer.train_step(trainable))
            else:
                log.warning("step %d: no sample has a response; skipping the update", step)
            metrics["time/train"] = time.perf_counter() - t

            result = sync.sync(version=step)
            metrics.update(result.metrics())
            metrics["time/sync"] = result.seconds
            if not result.checksum_ok:
                log.error("weight sync checksum mismatch after step %d: %s", step, result.mismatched[:5])

            is_last = step == cfg.trainer.max_steps
            if cfg.trainer.eval_every and test_prompts and (step % cfg.trainer.eval_every == 0 or is_last):
                metrics.update(run_eval())
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or (
                is_last and cfg.trainer.save_final
            ):
                save_checkpoint(
                    model, tokenizer, run_dir, step, write_resume_state(step), cfg.trainer.keep_last
                )
            if busy is not None and (fraction := busy[1].stop()) is not None:
                metrics[busy[0]] = fraction
            metrics["time/step"] = time.perf_counter() - step_start
            tracker.log_samples(step, samples)
            tracker.log_step(step, metrics)
            last = metrics
    finally:
        if busy is not None:
            busy[1].stop()
        if multiturn is not None:
            multiturn.close()
        tracker.close()
        rewards.close()
    return last
