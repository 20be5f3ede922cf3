"""Run `miles train` in a subprocess, as a user would."""

import os
import subprocess
import sys
from pathlib import Path


def run_miles(
    tmp_path: Path, *overrides: str, wandb: bool = False, run_dir: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline" if wandb else "disabled", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "miles",
            "train",
            *overrides,
            f"hydra.run.dir={run_dir or tmp_path / 'run'}",
            "logging.progress=false",
            f"logging.wandb={'true' if wandb else 'false'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
