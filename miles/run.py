"""Entry from Hydra: typed config object + run directory -> the RL loop or SFT."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from miles.config import MilesConfig
from miles.errors import MilesUserError


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
    if config.trainer.backend != "torch":
        raise MilesUserError(
            f"trainer.backend={config.trainer.backend} is not available yet; use trainer.backend=torch "
            "(the megatron and deepspeed backends are planned, see the README's feature status)"
        )
    if config.placement.mode != "embedded":
        raise MilesUserError(
            f"placement.mode={config.placement.mode} is not available yet; use placement.mode=embedded"
        )


def run(config: MilesConfig, run_dir: Path, resolved_yaml: str | None = None) -> dict[str, float]:
    check_supported(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved_yaml or OmegaConf.to_yaml(OmegaConf.structured(config)))
    if config.algorithm.name == "sft" or config.algorithm.policy_loss == "sft":
        from miles.sft import run_sft

        return run_sft(config, run_dir)
    from miles.loop import run_rl

    return run_rl(config, run_dir)
