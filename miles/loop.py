"""The RL loop on the embedded placement: in each process one device, the engine and trainer sharing weights.

step = rollout (engine) -> rewards -> advantages -> train (with mismatch metrics) -> weight sync (+checksum)
-> eval / checkpoint -> metrics.

With several processes (`placement.num_processes`, or torchrun; miles/distributed.py) each rank generates
and scores its share of the batch's groups, the advantages and batch metrics are computed over every rank's
samples, the trainer sums gradients across ranks, and rank 0 writes the run directory.
"""

from __future__ import annotations

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
from miles.distributed import SINGLE, DataParallel, gather_samples, reduce_metrics
from miles.errors import MilesUserError
from miles.evaluate import evaluate
from miles.model_io import load_model
from miles.resume import (
    DRAFT_DIR,
    DRAFT_HEAD_DIR,
    RunState,
    config_changes,
    find_checkpoint,
    read_run_state,
    restore_rng,
    write_run_state,
)
from miles.sample import Sample, SampleStatus
from miles.sft_data import end_of_turn_id
from miles.tracking import Tracker, check_new_run_dir, read_records, redact
from miles.trainer.group_filter import (
    combine_round_metrics,
    filter_metrics,
    kept_groups,
    load_group_filter,
    trainable,
)
from miles.trainer.overlong import apply_overlong_penalty
from miles.utilization import busy_meter

log = logging.getLogger("miles.loop")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_cpu_threads(threads: int) -> None:
    # On 2 shared cores a second intra-op thread makes tiny-model kernels tens of times slower.
    if threads > 0:
        torch.set_num_threads(threads)


def stop_ids(tokenizer: object, model_eos: list[int], formatter: PromptFormatter | None = None) -> list[int]:
    """The model's and the tokenizer's eos ids, and with chat-formatted prompts (`formatter`) the token the
    template ends an assistant turn with (`<|im_end|>`), which a base model's config may not list (it has
    `<|endoftext|>`)."""
    ids = set(model_eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    end_of_turn = end_of_turn_id(formatter) if formatter is not None else None
    if end_of_turn is not None:
        ids.add(end_of_turn)
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
    dropped_eval_prompts: int = 0  # held-out prompts over data.max_prompt_length: the eval runs without them


def dropped_metrics(inputs: RunInputs) -> dict[str, float]:
    return {
        "data/dropped_prompts": float(inputs.dropped_prompts),
        "data/dropped_eval_prompts": float(inputs.dropped_eval_prompts),
    }


SYNC_RETRIES = 1
"""Syncs repeated after a checksum mismatch before the run stops (a repeat that matches costs nothing)."""


def prepare_inputs(cfg: MilesConfig, dp: DataParallel = SINGLE) -> RunInputs:
    seed_everything(cfg.trainer.seed)
    set_cpu_threads(cfg.placement.cpu_threads)
    loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed)
    dp.broadcast_module(loaded.model)  # the replicas start from rank 0's weights, however they were made
    formatter = PromptFormatter(loaded.tokenizer, cfg.data, cfg.model.chat_template)
    train_rows, test_rows = load_rows(cfg.data)
    train_prompts, dropped = to_samples(train_rows, formatter, cfg.data.max_prompt_length)
    test_prompts, dropped_eval = to_samples(test_rows, formatter, cfg.data.max_prompt_length)
    eos = stop_ids(loaded.tokenizer, loaded.model.args.eos_token_ids, formatter)
    return RunInputs(loaded.model, loaded.tokenizer, train_prompts, test_prompts, dropped, eos, dropped_eval)


_SCHEDULE_KEYS = (
    "trainer.global_batch_size",
    "trainer.epochs_per_rollout",
    "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt",
)
"""Settings that change how many optimizer steps an RL step takes, so the LR schedule's length."""


def resume_run(
    cfg: MilesConfig,
    folder: Path,
    state: RunState,
    model: Any,
    engine: Any,
    trainer: Any,
    loader: PromptLoader,
    tracker: Tracker | None,
    dp: DataParallel = SINGLE,
) -> int:
    """Load a checkpoint's weights, optimizer, schedule, loader position and RNG states into the run, and
    the interrupted run's metrics up to it into this run's; returns the step it finished."""
    from miles.models.checkpoint import iter_hf_tensors, load_state_into

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
    if trainer.model is not model:  # the megatron backend trains a copy of the weights
        trainer.model.load_from(model)
    trainer.load_state_dict(state.trainer)
    resized = [c for c in changes if c.startswith(_SCHEDULE_KEYS)]
    if max_steps != state.max_steps:
        resized.append(f"trainer.max_steps: {state.max_steps} -> {max_steps}")
    if resized:
        # The cosine schedule ends at the run's last step from where it stands, with the steps a call now takes.
        log.info("the LR schedule is re-sized from the current position (%s)", "; ".join(resized))
        trainer.resize_schedule(max_steps - state.step)
    loader.load_state_dict(state.loader)
    engine_state = state.engine.get("ranks", [state.engine])  # one entry per rank of the saved run
    if len(engine_state) != dp.world_size:
        log.warning(
            "the checkpoint holds the engine state of %d process(es) and this run has %d: unseeded requests "
            "will not draw as they would have",
            len(engine_state),
            dp.world_size,
        )
    if dp.rank < len(engine_state) and engine_state[dp.rank]:
        engine.load_state_dict(engine_state[dp.rank])
    if tracker is not None:
        tracker.carry_over(folder.parent.parent, state.step)  # checkpoints/step_N/ -> the run folder
    restore_rng(state)
    log.info("resumed from %s (step %d)", folder, state.step)
    return state.step


def run_rl(cfg: MilesConfig, run_dir: Path, dp: DataParallel = SINGLE) -> dict[str, float]:
    from miles.rewards import RewardRunner
    from miles.rollout import Engine, SamplingParams
    from miles.rollout.draft_head import load_head
    from miles.rollout.draft_model import load_draft_model
    from miles.rollout.multiturn import MultiTurnRollout
    from miles.trainer import PolicyTrainer
    from miles.trainer.algorithms import compute_advantages
    from miles.trainer.backends import build_policy
    from miles.trainer.draft_head_trainer import DraftHeadTrainer
    from miles.trainer.draft_trainer import DraftTrainer
    from miles.weight_sync import InProcessWeightSync

    if cfg.rollout.spec_draft_train:
        _check_draft_training(cfg)  # before the models load
    inputs = prepare_inputs(cfg, dp)
    model, tokenizer, eos = inputs.model, inputs.tokenizer, inputs.stop_token_ids
    train_prompts, test_prompts = inputs.train_prompts, inputs.test_prompts
    loader = PromptLoader(train_prompts, cfg.rollout.rollout_batch_size, cfg.data.shuffle, cfg.data.seed)

    if cfg.rollout.generate_fn and cfg.trainer.routing_replay:
        raise MilesUserError(
            "trainer.routing_replay needs each sample's recorded experts, which a multi-turn sample "
            "(rollout.generate_fn) does not carry; turn one of them off"
        )
    ref_model = None
    if cfg.algorithm.kl_coef > 0:
        ref_model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, seed=cfg.trainer.seed).model
        ref_model.requires_grad_(False)
        dp.broadcast_module(ref_model)
    policy = build_policy(
        cfg.trainer.backend,
        model,
        cfg.trainer.routing_replay,
        cfg.trainer.precision,
        cfg.trainer.tensor_parallel_size,
    )
    trainer = PolicyTrainer(
        policy, cfg.trainer, cfg.algorithm, temperature=cfg.rollout.temperature, ref_model=ref_model, dp=dp
    )
    draft, head, draft_trainer = None, None, None
    if cfg.rollout.spec_draft_train and cfg.rollout.speculative == "head":
        head = load_head(model, cfg.rollout)
        dp.broadcast_module(head)
        draft_trainer = DraftHeadTrainer(head, model, cfg.trainer, cfg.rollout, dp)
    elif cfg.rollout.spec_draft_train:
        draft = load_draft_model(model, cfg.rollout)
        dp.broadcast_module(draft)
        draft_trainer = DraftTrainer(
            draft, model.args.vocab_size, cfg.trainer, cfg.rollout, cfg.algorithm, dp
        )
    # The KV pool takes its fraction of the memory the trainer's first update will not need (colocated).
    reserve = trainer.memory_reserve_bytes()
    if draft_trainer is not None:
        reserve += draft_trainer.memory_reserve_bytes()
    engine = Engine(model, tokenizer, cfg.rollout, reserve_bytes=reserve, draft_model=draft, draft_head=head)
    generate, multiturn = engine.generate, None
    if cfg.rollout.generate_fn:
        spec = plugins.normalize(cfg.rollout.generate_fn, "rollout.generate_fn")
        fn = plugins.load(spec, "rollout.generate_fn")
        multiturn = MultiTurnRollout(engine, fn, cfg.rollout.generate_timeout_s)
        generate = multiturn.generate
    # After it, `model` holds the trainer's weights; the fingerprints are compared across replicas only.
    sync = InProcessWeightSync(policy, engine, replica_fingerprints=dp.enabled)
    release_kv = cfg.rollout.release_kv_during_train and engine.device.type == "cuda"
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
    score_early = cfg.reward.score_during_rollout and multiturn is None
    group_filter, warned_short = load_group_filter(cfg.algorithm.group_filter), False
    eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
    resume_from, wandb_run_id = None, None
    if cfg.trainer.resume_from:
        # Rank 0's choice for every rank (with `auto`, another run may save a newer checkpoint meanwhile).
        found: str | MilesUserError
        try:
            found = str(find_checkpoint(cfg.trainer.resume_from, run_dir, cfg.recipe)) if dp.is_main else ""
            if found:  # checkpoints/step_N/ -> its run folder
                check_new_run_dir(run_dir, Path(found).parent.parent)
        except MilesUserError as e:
            found = e
        found = dp.broadcast_object(found)
        if isinstance(found, MilesUserError):
            raise found
        folder = Path(found)
        resume_from = (folder, read_run_state(folder))
        wandb_run_id = _continued_wandb_run(folder, resume_from[1])
    tracker = None
    if dp.is_main:
        tracker = Tracker(
            run_dir,
            cfg.logging,
            redact(asdict(cfg)),
            cfg.recipe,
            cfg.trainer.max_steps,
            tokenizer,
            wandb_run_id=wandb_run_id,
        )
    last: dict[str, float] = {}
    busy = busy_meter(model.device)  # util/gpu_busy_frac on CUDA, util/cpu_busy_frac on CPU
    first_step = 1
    if resume_from is not None:
        first_step = resume_run(cfg, *resume_from, model, engine, trainer, loader, tracker, dp) + 1
        if draft_trainer is not None:
            resume_draft(*resume_from, draft_trainer)
            engine.draft_weights_changed()
        elif (resume_from[0] / DRAFT_DIR).is_dir():
            log.warning(
                "%s holds a trained draft model, which this run does not use (rollout.spec_draft_train is "
                "off); to draft with it, set rollout.spec_draft_model=%s",
                resume_from[0],
                resume_from[0] / DRAFT_DIR,
            )
        elif (resume_from[0] / DRAFT_HEAD_DIR).is_dir():
            log.warning(
                "%s holds a trained draft head, which this run does not use (rollout.spec_draft_train is "
                "off); to draft with it, set rollout.speculative=head rollout.spec_head=%s",
                resume_from[0],
                resume_from[0] / DRAFT_HEAD_DIR,
            )
        if first_step > cfg.trainer.max_steps:
            raise MilesUserError(
                f"the checkpoint already finished step {first_step - 1} of trainer.max_steps="
                f"{cfg.trainer.max_steps}; raise trainer.max_steps to train further"
            )
        result = sync.sync(version=first_step - 1)  # the engine serves the checkpoint's weights from here on
        if not result.checksum_ok:
            raise RuntimeError(f"weight sync checksum mismatch after resuming: {result.mismatched[:5]}")

    def write_resume_state(step: int) -> Callable[[Path], None]:
        engine_state = engine.state_dict()
        if dp.enabled:  # every rank's (a collective: all ranks are here), written by rank 0
            engine_state = {"ranks": dp.all_gather_objects(engine_state)}
        run_id = tracker.wandb_run_id if tracker is not None and tracker.wandb_run_id else wandb_run_id
        # With tensor parallelism the optimizer state is gathered from the TP ranks, a collective: here, by the
        # TP group of rank 0 (the one that writes it).
        trainer_state = trainer.state_dict() if trainer.tp.enabled and trainer.dp.rank == 0 else None

        def write(folder: Path) -> None:
            draft_state = None
            if draft_trainer is not None:
                draft_trainer.save_weights(folder)
                draft_state = draft_trainer.state_dict()
            write_run_state(
                folder,
                step,
                redact(asdict(cfg)),
                trainer_state if trainer_state is not None else trainer.state_dict(),
                loader.state_dict(),
                engine_state,
                run_id,
                draft_state,
            )

        return write

    def run_eval() -> dict[str, float]:
        prompts = dp.shard(test_prompts)
        metrics, _ = evaluate(generate, rewards, prompts, eval_tokens, eos, list(cfg.rollout.stop))
        # The next step starts as it would after a resume: from an empty radix cache (the eval's prompts
        # would change its bf16 prefill rounding on a GPU), and with counters that are its own.
        engine.flush_cache()
        engine.metrics()
        if multiturn is not None:
            metrics["eval/generate_errors"] = multiturn.metrics()["rollout/generate_errors"]
        return reduce_metrics(dp, metrics, metrics.get("eval/num_samples", len(prompts)))

    try:
        # What loading the data dropped goes into the run's first record (log_step appends, it does not
        # merge): step 0's when the start is evaluated, else step 1's, so metrics.jsonl keeps one record a
        # step. A resumed run has it in the records of the run it goes on with.
        unreported = dropped_metrics(inputs) if first_step == 1 else {}
        if cfg.trainer.eval_every and test_prompts and first_step == 1:
            eval_metrics = run_eval()
            if tracker is not None:
                tracker.log_step(0, {**eval_metrics, **unreported})
            unreported = {}
        for step in range(first_step, cfg.trainer.max_steps + 1):
            step_start = time.perf_counter()
            if busy is not None:
                busy[1].start()
            own: dict[str, float] = {"time/rollout": 0.0, "time/reward": 0.0}
            samples, everyone, kept, reward_rounds = [], [], [], []
            step_seed, batches = cfg.rollout.seed * 1_000_003 + step, 0
            while True:  # one batch of prompts; more only while a group filter has kept too few groups
                # The first batch draws as a run without a filter does; the next ones draw other numbers (a
                # prompt may come round again).
                params.seed = step_seed if batches == 0 else step_seed * 1_000_033 + batches
                first_group = batches * cfg.rollout.rollout_batch_size  # group ids stay unique in the step
                t = time.perf_counter()
                batch = [replace(p, group_id=first_group + i) for i, p in enumerate(loader.next_batch())]
                if score_early:  # each sample's graders start while the others still generate
                    drawn = engine.generate(
                        dp.shard(batch), params, on_finish=lambda s: rewards.score_early([s])
                    )
                else:
                    drawn = generate(dp.shard(batch), params)  # this rank's groups, whole
                # Measured on this rank's share of the step; combined over the ranks at the end of the step.
                own["time/rollout"] += time.perf_counter() - t
                t = time.perf_counter()
                reward_rounds.append((rewards.score(drawn), float(len(drawn))))
                own["time/reward"] += time.perf_counter() - t
                drawn_everyone, _ = gather_samples(dp, drawn)  # batch-wide: every rank's samples
                samples += drawn
                everyone += drawn_everyone
                batches += 1
                if group_filter is None:
                    break
                kept += kept_groups(drawn_everyone, group_filter)
                if len(kept) >= cfg.rollout.rollout_batch_size or batches >= cfg.algorithm.filter_max_batches:
                    break
            own.update(engine.metrics())
            if multiturn is not None:
                own.update(multiturn.metrics())
            own.update(combine_round_metrics(reward_rounds))
            metrics: dict[str, float] = rollout_metrics(everyone, cfg.rollout.max_new_tokens)
            train_everyone, train_own = everyone, samples
            if group_filter is not None:
                metrics.update(filter_metrics(everyone, kept, batches, cfg.rollout.rollout_batch_size))
                if len(kept) < cfg.rollout.rollout_batch_size and not warned_short:
                    log.warning(
                        "step %d: algorithm.group_filter kept %d of the %d groups a step trains on in "
                        "%d batches (algorithm.filter_max_batches); the step trains on those (see "
                        "rollout/filter_kept_groups; warned once)",
                        step,
                        len(kept),
                        cfg.rollout.rollout_batch_size,
                        batches,
                    )
                    warned_short = True
                chosen = set(kept[: cfg.rollout.rollout_batch_size])
                train_everyone = [s for s in everyone if s.group_id in chosen]
                train_own = [s for s in samples if s.group_id in chosen]
            if cfg.algorithm.overlong_buffer:  # after the filter, which judges the rewards as scored
                algo = cfg.algorithm
                shaping = (cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
                metrics.update(apply_overlong_penalty(train_everyone, *shaping))
            # An aborted request (engine error, failed generate plugin) has no response: it costs its sample,
            # never the step, and stays out of its group's advantages (its reward 0 would lift the others').
            usable = [s for s in train_everyone if trainable(s)]
            metrics.update(compute_advantages(usable, cfg.algorithm))
            if dp.enabled:  # the batch-wide samples are copies: their advantages go to this rank's own
                advantages = {(s.group_id, s.index): s.advantage for s in usable}
                for sample in train_own:
                    sample.advantage = advantages.get((sample.group_id, sample.index), 0.0)
            trainable_samples = [s for s in train_own if trainable(s)]

            t = time.perf_counter()
            metrics["train/dropped_samples"] = float(len(train_everyone) - len(usable))
            releasing = release_kv and bool(usable)
            if releasing:
                engine.release_memory()
                own["time/kv_release"] = time.perf_counter() - t
            try:
                if head is not None:  # from the hidden states of the policy that drew the samples
                    _train_draft(draft_trainer, engine, samples, metrics, own)
                if usable:
                    # Every rank steps, with or without samples of its own.
                    metrics.update(trainer.train_step(trainable_samples))
                elif group_filter is not None and not kept:
                    log.warning(
                        "step %d: algorithm.group_filter kept no group in %d batches; skipping the update",
                        step,
                        batches,
                    )
                else:
                    log.warning("step %d: no sample has a response; skipping the update", step)
                if draft_trainer is not None and head is None:
                    _train_draft(draft_trainer, engine, samples, metrics, own)
            finally:
                if releasing:
                    resumed = time.perf_counter()
                    engine.resume_memory()
                    own["time/kv_release"] += time.perf_counter() - resumed
            # The policy's update and the KV release around it (the draft's update is time/draft_train).
            own["time/train"] = time.perf_counter() - t - own.get("time/draft_train", 0.0)

            sync_seconds = 0.0
            for attempt in range(1 + SYNC_RETRIES):
                result = sync.sync(version=step)
                sync_seconds += result.seconds
                checks = _replica_metrics(dp, result) if dp.enabled else {}
                if checks.get("sync/checksum_ok", result.checksum_ok):  # every rank's, where ranks compare
                    break
                # The engine would generate the next rollout from weights the policy does not have: the
                # policy that generates would no longer be the policy that learns. Sync again, then stop.
                log.error("weight sync checksum mismatch after step %d: %s", step, result.mismatched[:5])
                if attempt == SYNC_RETRIES:
                    raise RuntimeError(
                        f"the engine's weights differ from the policy's after step {step} and {SYNC_RETRIES} "
                        f"more sync(s) (first differing: {result.mismatched[:5]}); the last checkpoint is in "
                        f"{run_dir / 'checkpoints'} (resume with trainer.resume_from)"
                    )
            own.update(result.metrics())
            own["time/sync"] = sync_seconds
            own["sync/retries"] = float(attempt)
            metrics.update(checks)
            if not metrics.get("sync/replicas_equal", 1.0):
                log.error("after step %d the ranks' weights differ", step)

            is_last = step == cfg.trainer.max_steps
            if cfg.trainer.eval_every and test_prompts and (step % cfg.trainer.eval_every == 0 or is_last):
                metrics.update(run_eval())
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or (
                is_last and cfg.trainer.save_final
            ):
                write_extra = write_resume_state(step)
                if dp.is_main:
                    save_checkpoint(model, tokenizer, run_dir, step, write_extra, cfg.trainer.keep_last)
            if busy is not None and (fraction := busy[1].stop()) is not None:
                own[busy[0]] = fraction
            own["time/step"] = time.perf_counter() - step_start
            # The batch-wide values win where both have a key (`rollout/aborted` counts the samples a failed
            # generate plugin cost too, which the engine's counter does not).
            metrics = {**reduce_metrics(dp, own, len(samples)), **metrics, **unreported}
            unreported = {}
            if tracker is not None:  # in one process's order (the ranks' samples come rank after rank)
                tracker.log_samples(step, sorted(everyone, key=lambda s: (s.group_id, s.index)))
                tracker.log_step(step, metrics)
            last = metrics
    finally:
        if busy is not None:
            busy[1].stop()
        if multiturn is not None:
            multiturn.close()
        if tracker is not None:
            tracker.close()
        rewards.close()
    return last


def _train_draft(
    draft_trainer: Any, engine: Any, samples: list[Sample], metrics: dict[str, float], own: dict[str, float]
) -> None:
    """One RL step's update of the draft model or head (`time/draft_train`, not counted in `time/train`)."""
    began = time.perf_counter()
    metrics.update(draft_trainer.train_step(samples))
    engine.draft_weights_changed()  # a draft model's cached keys and values are stale (a head caches none)
    own["time/draft_train"] = time.perf_counter() - began


def _check_draft_training(cfg: MilesConfig) -> None:
    if cfg.rollout.speculative not in ("draft", "head") or cfg.rollout.deterministic:
        raise MilesUserError(
            "rollout.spec_draft_train trains the draft model of rollout.speculative=draft or the draft head of "
            "rollout.speculative=head (which deterministic mode turns off); got rollout.speculative="
            f"{cfg.rollout.speculative}, rollout.deterministic={cfg.rollout.deterministic}"
        )
    if cfg.trainer.tensor_parallel_size > 1:
        raise MilesUserError(
            "rollout.spec_draft_train is not supported with trainer.tensor_parallel_size > 1 yet (each rank "
            "would train the draft on its tensor-parallel group's samples); turn one of them off"
        )
    if cfg.rollout.speculative == "draft" and not cfg.rollout.spec_draft_model:
        raise MilesUserError(
            "rollout.spec_draft_train needs the draft to start from: set rollout.spec_draft_model"
        )
    from miles.trainer.draft_trainer import check_draft_settings

    try:
        check_draft_settings(cfg.rollout)
    except ValueError as err:
        raise MilesUserError(str(err)) from err


def resume_draft(folder: Path, state: RunState, draft_trainer: Any) -> None:
    """Load the trained draft (model or head) and its optimizer state of a checkpoint; a checkpoint of a run
    that did not train this kind of draft leaves the draft as the run's settings loaded it."""
    if state.draft is None or not (folder / draft_trainer.weights_dir).is_dir():
        log.warning(
            "%s holds no trained draft of this kind (no %s/): the draft starts again from the run's settings",
            folder,
            draft_trainer.weights_dir,
        )
        return
    draft_trainer.load_weights(folder)
    draft_trainer.load_state_dict(state.draft)


def _continued_wandb_run(checkpoint: Path, state: RunState) -> str | None:
    """The interrupted run's W&B run id, when this run can go on with it: W&B drops steps at or below a
    run's last one, so only if the interrupted run logged nothing past the checkpoint's step (it crashed
    before its next step finished). Otherwise the resumed run gets a W&B run of its own."""
    if not state.wandb_run_id:
        return None
    records = read_records(checkpoint.parent.parent)
    last = records[-1].get("step") if records else None
    if last != state.step:
        log.info(
            "the interrupted run logged up to step %s, past the checkpoint's %d: this run gets a new W&B run",
            last,
            state.step,
        )
        return None
    return state.wandb_run_id


def _replica_metrics(dp: DataParallel, result: Any) -> dict[str, float]:
    """`sync/checksum_ok` of every rank, and whether every rank's weights equal rank 0's, bit for bit."""
    ok = dp.all_reduce_floats([float(result.checksum_ok)], "min")[0]
    prints = dp.all_gather_objects(result.fingerprints)
    equal = all(p == prints[0] for p in prints[1:])
    return {"sync/checksum_ok": ok, "sync/replicas_equal": float(equal)}
