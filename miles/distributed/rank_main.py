"""A rank that `launch` started: `python -m miles.distributed.rank_main RUN_DIR` runs the run described by
its config, as one process of the group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from miles.config import MilesConfig
from miles.distributed.launcher import CONFIG_ENV, exit_with_launcher
from miles.errors import MilesUserError
from miles.run import run
from miles.tracking import redact_logs


def main(run_dir: str) -> int:
    """A process `launch` started: the run described by `run_dir/config.yaml`."""
    exit_with_launcher()
    redact_logs()
    folder = Path(run_dir)
    text = Path(os.environ.get(CONFIG_ENV) or folder / "config.yaml").read_text()
    merged = OmegaConf.merge(OmegaConf.structured(MilesConfig), OmegaConf.create(text))
    config: MilesConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    try:
        run(config, folder, resolved_yaml=text)
    except MilesUserError as e:
        print(f"miles train (rank {os.environ.get('RANK')}): error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
