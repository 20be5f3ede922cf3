"""Entry from Hydra: typed config object + run directory -> the RL loop or SFT."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from miles import distributed
from miles.config import MilesConfig
from miles.config.validate import validate
from miles.errors import MilesUserError
from miles.placement.ray.parts import build_ray_parts
from miles.rl import run_rl
from miles.rl.parts import build_parts
from miles.run_dir import lock as run_dir_lock
from miles.run_dir import unlock
from miles.sft.loop import run_sft
from miles.tracking import check_new_run_dir, read_records, redact_logs, redact_text, redact_yaml

log = logging.getLogger("miles.run")


def run_from_hydra(cfg: DictConfig) -> None:
    """A run started by `miles train`: a refused start leaves no run folder behind; a run that fails later
    says why in its run.log. Errors end the process here, never in Hydra, whose failure banner would print
    every override verbatim (API keys included)."""
    from hydra.core.hydra_config import HydraConfig

    redact_logs()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    config: MilesConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    try:
        held = run_dir_lock(run_dir)
    except MilesUserError as e:
        print(f"miles train: error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(2)
    try:
        validate(config)
    except MilesUserError as e:
        unlock(held)
        _remove_if_only_hydra(run_dir)
        print(f"miles train: error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(2)
    print(f"miles train: run folder {run_dir}", flush=True)
    try:
        run(config, run_dir, resolved_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    except MilesUserError as e:
        log.error("the run stopped: %s", e)
        print(f"miles train: error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        log.error("the run was interrupted (run folder %s)%s", run_dir, f": {e}" if str(e) else "")
        print(f"miles train: interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        log.exception("the run failed (run folder %s)", run_dir)
        print(f"miles train: error: {redact_text(f'{type(e).__name__}: {e}')}", file=sys.stderr)
        sys.exit(1)
    finally:
        unlock(held)


def run(config: MilesConfig, run_dir: Path, resolved_yaml: str | None = None) -> dict[str, float]:
    validate(config)
    if not config.trainer.resume_from:  # before config.yaml is written over that run's (a resume: the loop)
        check_new_run_dir(run_dir)
    resolved_yaml = resolved_yaml or OmegaConf.to_yaml(OmegaConf.structured(config))
    embedded = config.placement.mode == "embedded"  # ray: this process drives actors, launched by Ray
    if embedded and distributed.needs_launch(config.placement.num_processes):
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
    dp = distributed.init_data_parallel(
        config.placement.num_processes if embedded else 1, config.model.device
    )
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
            result = run_sft(config, run_dir, dp)
        else:
            result = run_rl(config, run_dir, dp, build_parts if embedded else build_ray_parts)
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
