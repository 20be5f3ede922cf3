"""The one check of a whole config at start: every value the schema cannot type-check is checked here,
before the run folder is made or any model loads, with a message that says what to do."""

from __future__ import annotations

import math

from miles.config.schema import MilesConfig
from miles.config.weights_release import check_weights_release
from miles.data import fewshot_turns
from miles.distributed import world_from_env
from miles.errors import MilesUserError
from miles.models.checkpoint import DTYPES
from miles.rollout import SamplingParams
from miles.rollout.checks import check_rollout_config
from miles.trainer.algorithms import get_advantage, get_policy_loss
from miles.trainer.backends import check_backend, check_tensor_parallel
from miles.trainer.draft.model_trainer import check_draft_settings
from miles.trainer.group_filter import load_group_filter
from miles.trainer.losses import LOSS_AGG_MODES
from miles.trainer.offload import check_memory_plan
from miles.trainer.policy_trainer import FLOAT16_REFUSED
from miles.trainer.recompute import check_recompute


def validate(config: MilesConfig) -> None:
    """Refuse a config the run would fail on later (after the models loaded, or mid-run)."""
    resolve_auto_dtype(config)
    check_placement(config)
    check_engine_process(config)
    check_async(config)
    check_ranges(config)
    check_algorithm(config)
    try:
        check_rollout_config(config.rollout)  # what the engine would refuse once the model loaded
    except ValueError as err:
        raise MilesUserError(str(err)) from err
    if config.rollout.spec_draft_train:
        check_draft_training(config)
    if config.rollout.generate_fn and config.trainer.routing_replay:
        raise MilesUserError(
            "trainer.routing_replay needs each sample's recorded experts, which a multi-turn sample "
            "(rollout.generate_fn) does not carry; turn one of them off"
        )


def resolve_auto_dtype(config: MilesConfig) -> None:
    """`model.dtype=auto`: bfloat16 on a GPU that computes in it, float32 elsewhere (CPUs without bf16 matrix
    units run it about 10x slower than float32), decided once so every process loads the same weights."""
    if config.model.dtype != "auto":
        return
    import torch

    from miles.model_io import pick_device

    on_gpu = pick_device(config.model.device).type == "cuda" and torch.cuda.is_bf16_supported()
    config.model.dtype = "bfloat16" if on_gpu else "float32"


def check_placement(config: MilesConfig) -> None:
    """Options the schema names but this build cannot run yet fail at start, not mid-run."""
    check_backend(config.trainer.backend)
    if config.trainer.backend == "deepspeed":
        from miles.trainer.deepspeed.config import check_deepspeed_settings

        check_deepspeed_settings(config.trainer)
    check_recompute(config.trainer.recompute)
    check_memory_plan(config)
    check_weights_release(config)
    if config.placement.mode not in ("embedded", "ray"):
        raise MilesUserError(
            f"placement.mode={config.placement.mode}: use embedded (one process, or placement.num_processes=N "
            "of them) or ray (trainer ranks and engines as Ray actors)"
        )
    if config.placement.mode == "ray":
        check_ray(config)
    if config.placement.num_processes < 1:
        raise MilesUserError(
            f"placement.num_processes must be at least 1, got {config.placement.num_processes}"
        )
    if config.algorithm.filter_max_batches < 1:
        raise MilesUserError(
            f"algorithm.filter_max_batches must be at least 1, got {config.algorithm.filter_max_batches}"
        )
    load_group_filter(config.algorithm.group_filter)  # a bad spec fails here, before any model loads
    tp = config.trainer.tensor_parallel_size
    check_tensor_parallel(config.trainer.backend, tp)
    check_expert_parallel_config(config)
    if tp > 1:
        if config.placement.num_processes == 1 and world_from_env() == 1:
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tp} splits a replica over {tp} processes: set "
                f"placement.num_processes to a multiple of {tp} (or start the run under torchrun)"
            )
        if config.placement.num_processes > 1 and config.placement.num_processes % tp:
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tp} must divide placement.num_processes="
                f"{config.placement.num_processes} (each group of {tp} processes splits one model replica)"
            )


def check_expert_parallel_config(config: MilesConfig) -> None:
    """Expert (tensor) parallelism: megatron only, and sizes whose product divides the processes (the model's
    own dimensions are checked when it loads: trainer/megatron/parallel.py, check_parallel_sizes)."""
    trainer, processes = config.trainer, max(config.placement.num_processes, world_from_env())
    ep, etp = trainer.expert_parallel_size, trainer.expert_tensor_parallel_size
    if ep == 1 and etp in (None, 1):
        return
    if trainer.backend != "megatron":
        raise MilesUserError(
            "trainer.expert_parallel_size and trainer.expert_tensor_parallel_size need trainer.backend=megatron"
        )
    etp = trainer.tensor_parallel_size if etp is None else etp
    if ep < 1 or etp < 1 or processes % (ep * etp):
        raise MilesUserError(
            f"trainer.expert_parallel_size={ep} x trainer.expert_tensor_parallel_size={etp} must divide "
            f"placement.num_processes={processes} (each group of that many processes holds every expert once)"
        )


def check_ranges(config: MilesConfig) -> None:
    """Numbers that type-check but cannot run: each names its key, what it got and what it takes."""
    trainer, rollout = config.trainer, config.rollout
    at_least = {
        "trainer.max_steps": (trainer.max_steps, 0),
        "trainer.save_every": (trainer.save_every, 0),
        "trainer.keep_last": (trainer.keep_last, 0),
        "trainer.eval_every": (trainer.eval_every, 0),
        "trainer.stop_after_failed_steps": (trainer.stop_after_failed_steps, 0),
        "trainer.micro_batch_tokens": (trainer.micro_batch_tokens, 1),
        "trainer.sft_batch_size": (trainer.sft_batch_size, 1),
        "rollout.max_new_tokens": (rollout.max_new_tokens, 1),
        "rollout.kv_cache_bytes": (rollout.kv_cache_bytes, 1),
        "data.max_prompt_length": (config.data.max_prompt_length, 1),
    }
    for key, (value, low) in at_least.items():
        if value < low:
            raise MilesUserError(f"{key} must be at least {low}, got {value}")
    if trainer.eval_max_new_tokens is not None and trainer.eval_max_new_tokens < 1:
        raise MilesUserError(
            f"trainer.eval_max_new_tokens must be at least 1, got {trainer.eval_max_new_tokens}"
        )
    if not (math.isfinite(trainer.lr) and trainer.lr > 0):
        raise MilesUserError(f"trainer.lr must be a finite number above 0, got {trainer.lr}")
    try:  # the sampling settings as the engine will read them, by the one builder of them
        SamplingParams.from_config(rollout)
    except ValueError as err:
        raise MilesUserError(f"rollout.{err}") from err
    if rollout.speculative == "draft" and not rollout.spec_draft_model:
        raise MilesUserError(
            "rollout.speculative=draft needs a draft model: set rollout.spec_draft_model to a checkpoint folder "
            "(a smaller model with the same tokenizer), or use rollout.speculative=ngram"
        )
    if not 0 < rollout.kv_cache_fraction <= 1:
        raise MilesUserError(f"rollout.kv_cache_fraction must be in (0, 1], got {rollout.kv_cache_fraction}")
    if config.data.task_config and not config.data.source.startswith("reasoning_gym:"):
        raise MilesUserError(
            f"data.task_config sets a reasoning-gym task's generator; data.source={config.data.source!r} takes "
            "none (use data.source=reasoning_gym:<task>, or drop data.task_config)"
        )
    if config.data.fewshot and config.data.prompt_template is not None:
        raise MilesUserError(
            "data.fewshot adds chat turns, which data.prompt_template (plain text) has no place for: drop one "
            "of them, or write the examples into the template"
        )
    fewshot_turns(config.data.fewshot)  # a malformed example fails here, not at the first prompt


TRANSPORTS = ("auto", "inprocess", "cuda_ipc", "shm", "broadcast")


def check_engine_process(config: MilesConfig) -> None:
    """`placement.engine_process` and the transport its weights travel by agree, and nothing the engine
    process cannot do yet is asked of it."""
    transport, separate = config.weight_sync.transport, config.placement.engine_process
    if transport not in TRANSPORTS:
        raise MilesUserError(f"weight_sync.transport={transport}: use one of {', '.join(TRANSPORTS)}")
    if config.placement.mode == "ray":
        return  # check_ray
    if not separate and transport not in ("auto", "inprocess"):
        raise MilesUserError(
            f"weight_sync.transport={transport} moves weights to an engine in another process: set "
            "placement.engine_process=true (or leave weight_sync.transport=auto)"
        )
    if separate and transport == "inprocess":
        raise MilesUserError(
            "placement.engine_process=true puts the engine in another process, which weight_sync.transport="
            "inprocess cannot reach: use auto, shm (CPU), cuda_ipc (GPU) or broadcast"
        )
    if not separate:
        return
    unsupported = {
        "placement.num_processes > 1": config.placement.num_processes > 1,
        "trainer.tensor_parallel_size > 1": config.trainer.tensor_parallel_size > 1,
        "trainer.expert_parallel_size > 1": config.trainer.expert_parallel_size > 1,
        "rollout.generate_fn (multi-turn plugins drive a local engine)": bool(config.rollout.generate_fn),
        "rollout.spec_draft_train": config.rollout.spec_draft_train,
        "trainer.routing_replay": config.trainer.routing_replay,
    }
    for what, asked in unsupported.items():
        if asked:
            raise MilesUserError(
                f"placement.engine_process=true does not support {what} yet; turn one of them off"
            )


def check_async(config: MilesConfig) -> None:
    """`trainer.async_rollout=one_step` needs engines that hold weights of their own (the embedded engine
    runs the very module the update changes) and an off-policy correction for the one-update lag."""
    mode = config.trainer.async_rollout
    if mode not in ("off", "one_step"):
        raise MilesUserError(f"trainer.async_rollout={mode}: use off or one_step")
    if mode == "off":
        return
    if config.placement.mode != "ray" and not config.placement.engine_process:
        raise MilesUserError(
            "trainer.async_rollout=one_step generates while the policy updates, so the engines need weights of "
            "their own: use placement=ray, or placement.engine_process=true"
        )
    if not config.algorithm.tis:
        raise MilesUserError(
            "trainer.async_rollout=one_step trains on samples drawn one update earlier: it needs the off-policy "
            "correction, algorithm.tis=true (truncated importance sampling against the rollout logprobs)"
        )
    if config.rollout.release_kv_during_train:
        raise MilesUserError(
            "trainer.async_rollout=one_step generates during the update, so the KV pool cannot be lent to it: "
            "set rollout.release_kv_during_train=false"
        )


def check_ray(config: MilesConfig) -> None:
    """`placement.mode=ray`: counts that make a layout, a transport that reaches the engines, and nothing
    this placement cannot run yet."""
    placement, transport = config.placement, config.weight_sync.transport
    for key in ("num_processes", "max_engine_restarts"):
        if getattr(placement, key) < (1 if key == "num_processes" else 0):
            raise MilesUserError(f"placement.{key} is too small: {getattr(placement, key)}")
    if placement.num_engines < 0 or placement.cpus_per_actor <= 0 or placement.engine_hang_s <= 0:
        raise MilesUserError(
            "placement.num_engines must be >= 0 and placement.cpus_per_actor, engine_hang_s > 0"
        )
    if placement.colocate and placement.num_engines not in (0, placement.num_processes):
        raise MilesUserError(
            f"placement.colocate=true puts one engine beside each trainer rank: placement.num_engines="
            f"{placement.num_engines} must be 0 or placement.num_processes={placement.num_processes} (or set "
            "placement.colocate=false for engines on devices of their own)"
        )
    if transport == "inprocess":
        raise MilesUserError(
            "placement.mode=ray runs the engines in actors of their own, which weight_sync.transport=inprocess "
            "cannot reach: use auto, shm / cuda_ipc (colocated) or broadcast"
        )
    if not placement.colocate and transport == "cuda_ipc":
        raise MilesUserError(
            "weight_sync.transport=cuda_ipc needs the engine on its trainer rank's GPU: set placement.colocate="
            "true, or use broadcast (auto) for engines on GPUs of their own"
        )
    unsupported = {
        "placement.engine_process=true (the engines are actors already)": placement.engine_process,
        "trainer.tensor_parallel_size > 1": config.trainer.tensor_parallel_size > 1,
        "trainer.expert_parallel_size > 1": config.trainer.expert_parallel_size > 1,
        "rollout.spec_draft_train": config.rollout.spec_draft_train,
        "trainer.routing_replay": config.trainer.routing_replay,
        "SFT (algorithm.name=sft)": config.algorithm.name == "sft" or config.algorithm.policy_loss == "sft",
    }
    for what, asked in unsupported.items():
        if asked:
            raise MilesUserError(
                f"placement.mode=ray does not support {what} yet; use placement.mode=embedded"
            )


GROUP_BASELINES = ("grpo", "dr_grpo", "rloo")
"""Built-in estimators whose baseline is the prompt's other samples."""


def check_algorithm(config: MilesConfig) -> None:
    """Settings the loop reads only once a step has been generated fail at start instead (a typo in
    algorithm.advantage would otherwise surface after the models loaded and the first rollout ran)."""
    algorithm, rollout = config.algorithm, config.rollout
    if config.model.dtype not in DTYPES:
        raise MilesUserError(f"model.dtype={config.model.dtype}: use one of {', '.join(DTYPES)}")
    if config.model.dtype == "float16":  # (the trainer refuses it too, but only after the run folder exists)
        raise MilesUserError(FLOAT16_REFUSED)
    for key in ("global_batch_size", "epochs_per_rollout"):
        if getattr(config.trainer, key) < 1:
            raise MilesUserError(f"trainer.{key} must be at least 1, got {getattr(config.trainer, key)}")
    sft = algorithm.name == "sft" or algorithm.policy_loss == "sft"
    lookups = [("policy_loss", algorithm.policy_loss, get_policy_loss)]
    if not sft:
        lookups.append(("advantage", algorithm.advantage, get_advantage))
    for key, name, lookup in lookups:
        try:
            lookup(name)
        except (KeyError, ValueError, ImportError, AttributeError, TypeError) as e:
            raise MilesUserError(f"algorithm.{key}={name}: {e.args[0] if e.args else e}") from e
    if sft:
        return
    buffer = algorithm.overlong_buffer
    if (buffer and not 0 < buffer < rollout.max_new_tokens) or algorithm.overlong_penalty < 0:
        raise MilesUserError(
            f"algorithm.overlong_buffer={buffer} must be 0 (off) or between 1 and rollout.max_new_tokens - 1 "
            f"({rollout.max_new_tokens - 1}), and algorithm.overlong_penalty >= 0"
        )
    if buffer and rollout.generate_fn:
        raise MilesUserError(
            "algorithm.overlong_buffer counts a response against rollout.max_new_tokens, which bounds one "
            "turn of a multi-turn rollout (rollout.generate_fn), not the whole trajectory; turn one of them off"
        )
    if algorithm.loss_agg not in LOSS_AGG_MODES:
        raise MilesUserError(
            f"algorithm.loss_agg={algorithm.loss_agg}: use one of {', '.join(LOSS_AGG_MODES)}"
        )
    for key, value in (
        ("rollout_batch_size", rollout.rollout_batch_size),
        ("n_samples_per_prompt", rollout.n_samples_per_prompt),
    ):
        if value < 1:
            raise MilesUserError(f"rollout.{key} must be at least 1, got {value}")
    if (
        rollout.n_samples_per_prompt == 1
        and algorithm.advantage in GROUP_BASELINES
        and not rollout.generate_fn
    ):
        # A group of one has no baseline: every advantage would be 0 and the run would learn nothing.
        raise MilesUserError(
            f"algorithm.advantage={algorithm.advantage} compares the samples of one prompt, and "
            "rollout.n_samples_per_prompt=1 leaves each alone (every advantage 0, nothing learned): set "
            "rollout.n_samples_per_prompt to 2 or more, or algorithm.advantage=reinforce (a batch-mean baseline)"
        )
    if config.trainer.routing_replay and not rollout.record_routing:
        raise MilesUserError(
            "trainer.routing_replay replays the experts the engine chose at rollout: set "
            "rollout.record_routing=true too"
        )


def check_draft_training(cfg: MilesConfig) -> None:
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
    try:
        check_draft_settings(cfg.rollout)
    except ValueError as err:
        raise MilesUserError(str(err)) from err
