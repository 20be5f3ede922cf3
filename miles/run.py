"""Entry from Hydra: typed config object + run directory -> the RL loop or SFT."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from miles.config import MilesConfig
from miles.errors import MilesUserError
from miles.tracking import check_new_run_dir, read_records, redact_yaml


def run_from_hydra(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    config: MilesConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    try:
        run(config, run_dir, resolved_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    except MilesUserError as e:
        print(f"miles train: error: {e}", file=sys.stderr)
        sys.exit(2)


def check_supported(config: MilesConfig) -> None:
    """Options the schema names but this build cannot run yet fail at start, not mid-run."""
    from miles import distributed
    from miles.trainer.backends import check_backend
    from miles.trainer.group_filter import load_group_filter

    check_backend(config.trainer.backend)
    if config.placement.mode != "embedded":
        raise MilesUserError(
            f"placement.mode={config.placement.mode} is not available yet; use placement.mode=embedded "
            "(with placement.num_processes=N for N data-parallel processes)"
        )
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
    if tp != 1:
        if tp < 1 or config.trainer.backend != "megatron":
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tp} needs trainer.backend=megatron and a size >= 1"
            )
        if config.placement.num_processes == 1 and distributed.world_from_env() == 1:
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tp} splits a replica over {tp} processes: set "
                f"placement.num_processes to a multiple of {tp} (or start the run under torchrun)"
            )
        if config.placement.num_processes > 1 and config.placement.num_processes % tp:
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tp} must divide placement.num_processes="
                f"{config.placement.num_processes} (each group of {tp} processes splits one model replica)"
            )


GROUP_BASELINES = ("grpo", "dr_grpo", "rloo")
"""Built-in estimators whose baseline is the prompt's other samples."""


def check_algorithm(config: MilesConfig) -> None:
    """Settings the loop reads only once a step has been generated fail at start instead (a typo in
    algorithm.advantage would otherwise surface after the models loaded and the first rollout ran)."""
    from miles.models.checkpoint import DTYPES
    from miles.trainer.algorithms import get_advantage, get_policy_loss
    from miles.trainer.losses import LOSS_AGG_MODES
    from miles.trainer.policy_trainer import FLOAT16_REFUSED

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


def run(config: MilesConfig, run_dir: Path, resolved_yaml: str | None = None) -> dict[str, float]:
    from miles import distributed

    check_supported(config)
    check_algorithm(config)
    if not config.trainer.resume_from:  # before config.yaml is written over that run's (a resume: the loop)
        check_new_run_dir(run_dir)
    resolved_yaml = resolved_yaml or OmegaConf.to_yaml(OmegaConf.structured(config))
    if distributed.needs_launch(config.placement.num_processes):
        distributed.check_devices(config.placement.num_processes, config.model.device)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(redact_yaml(resolved_yaml))
        code = distributed.launch(run_dir, config.placement.num_processes, config_text=resolved_yaml)
        if code != 0:
            raise MilesUserError(
                f"a process of the run exited with code {code}; its error is printed above (run folder {run_dir})"
            )
        records = read_records(run_dir)
        return records[-1] if records else {}
    dp = distributed.init_data_parallel(config.placement.num_processes, config.model.device)
    finished = False
    try:
        if dp.enabled:
            # Under torchrun each rank's Hydra picked its own timestamped folder; the run's is rank 0's.
            own, run_dir = run_dir, Path(dp.broadcast_object(str(run_dir)))
            if own.resolve() != run_dir.resolve():
                _remove_if_only_hydra(own)
            if dp.on_cuda:  # one GPU per rank, whichever one the config named
                config.model.device = f"cuda:{dp.local_rank}"
        if dp.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(redact_yaml(resolved_yaml))  # no API keys in run files
        if config.algorithm.name == "sft" or config.algorithm.policy_loss == "sft":
            from miles.sft import run_sft

            result = run_sft(config, run_dir, dp)
        else:
            from miles.loop import run_rl

            result = run_rl(config, run_dir, dp)
        finished = True
        return result
    finally:
        if finished:  # after a failure, leave the group as it is: tearing it down may wait for the others
            distributed.shutdown(dp)


def _remove_if_only_hydra(folder: Path) -> None:
    """A folder holding nothing but what Hydra writes at start (`.hydra/`, its log): another rank's."""
    import shutil

    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra", "run.log"}:
        shutil.rmtree(folder, ignore_errors=True)
