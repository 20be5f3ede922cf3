"""Claiming a run folder, so that two runs never write into one: a default (timestamped) name is created
exclusively, with a suffix when another run took it first; a folder the user names is held by a lock file
with the holder's pid, refused while that process lives."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from miles.errors import MilesUserError

LOCK = ".miles-run.lock"


def claim_default(parent: Path, now: datetime.datetime | None = None) -> Path:
    """A new folder `parent/<date_time>` (`_1`, `_2`, ... when taken), created here and so this run's."""
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    parent.mkdir(parents=True, exist_ok=True)
    for suffix in range(10_000):
        folder = parent / (stamp if suffix == 0 else f"{stamp}_{suffix}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise MilesUserError(f"no free run folder name under {parent} for {stamp}; set hydra.run.dir=DIR")


def lock(folder: Path) -> Path:
    """Hold `folder` for this process; a MilesUserError when a live process holds it. Returns the lock file
    (remove it with `unlock`; a lock whose process is gone is taken over)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is not None and holder != os.getpid() and process_alive(holder):
                raise MilesUserError(
                    f"{folder} is the run folder of a run still going (pid {holder}); pick another "
                    "hydra.run.dir, or wait for that run to end"
                ) from None
            path.unlink(missing_ok=True)  # its run is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    raise MilesUserError(f"could not lock {folder}: another run keeps taking it")


def unlock(path: Path) -> None:
    if _holder(path) == os.getpid():
        path.unlink(missing_ok=True)


def _holder(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
