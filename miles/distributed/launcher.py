"""Starting the ranks of a multi-process run on this machine (`placement.num_processes=N`), and stopping
them together: one failed or interrupted rank stops the others, which would wait in a collective forever."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from miles.errors import MilesUserError
from miles.run_dir import process_alive

LAUNCHED_ENV = "MILES_LAUNCHED_BY"
"""Set in the processes `launch` starts, so they do not launch again."""
STORE_ENV = "MILES_STORE_FILE"
"""The file the ranks of `launch` rendezvous in (no TCP port to pick)."""
CONFIG_ENV = "MILES_CONFIG_FILE"
"""The resolved config the ranks of `launch` run, unredacted (the run folder's config.yaml may have its
secrets masked), in the launch's private store folder."""


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def needs_launch(requested: int) -> bool:
    """True when `placement.num_processes` asks for processes nobody has started yet."""
    return requested > 1 and world_from_env() == 1 and LAUNCHED_ENV not in os.environ


def check_devices(num_processes: int, device: str) -> None:
    """Fail before starting anything when the processes cannot each have a GPU of their own."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return
    if not torch.cuda.is_available():
        raise MilesUserError(f"model.device={device} but CUDA is not available; use model.device=cpu or auto")
    visible = torch.cuda.device_count()
    if num_processes > visible:
        raise MilesUserError(
            f"placement.num_processes={num_processes} needs one GPU per process and {visible} are visible; "
            f"use placement.num_processes={visible} (or model.device=cpu)"
        )


def launch(
    run_dir: Path,
    num_processes: int,
    poll_s: float = 0.2,
    command: list[str] | None = None,
    config_text: str | None = None,
) -> int:
    """Start `num_processes` ranks of the run whose resolved config is `config_text` (else
    `run_dir/config.yaml`) on this machine and wait for them. The ranks read it from a copy in the launch's
    private folder, so the run folder's config.yaml may have its secrets masked. If one fails, the others
    are stopped (a rank that died leaves the rest waiting in a collective), and so are they all if this
    process is interrupted or terminated. Returns the first non-zero exit code, or 0. (`command` replaces
    the rank's program, for tests.)"""
    # The ranks meet in a file store made fresh for this launch: a TCP port probed free here could be taken
    # by another program before rank 0 binds it. The folder names its launcher, so one a killed launcher
    # left behind is removed by the next.
    remove_stale_stores(Path(tempfile.gettempdir()))
    store_dir = tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-")  # only this user may read it
    config_env: dict[str, str] = {}
    if config_text is None and (Path(run_dir) / "config.yaml").is_file():
        config_text = (Path(run_dir) / "config.yaml").read_text()
    if config_text is not None:
        config_file = os.path.join(store_dir, "config.yaml")
        with open(os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(config_text)
        config_env[CONFIG_ENV] = config_file
    procs: list[subprocess.Popen[bytes]] = []

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # through the `finally` below, which stops the ranks

    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    code = 0
    try:
        for rank in range(num_processes):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(num_processes),
                "LOCAL_WORLD_SIZE": str(num_processes),
                STORE_ENV: os.path.join(store_dir, "store"),
                LAUNCHED_ENV: str(os.getpid()),
                **config_env,
            }
            cmd = command or [sys.executable, "-m", "miles.distributed.rank_main", str(run_dir)]
            procs.append(subprocess.Popen(cmd, env=env))
        while True:
            codes = [p.poll() for p in procs]  # every rank, each round
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
    finally:
        _stop(procs)
        shutil.rmtree(store_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


_STORE_PREFIX = "miles-launch-"


def remove_stale_stores(folder: Path) -> None:
    """Remove the store folders of launchers that are gone (killed with SIGKILL: no `finally` ran)."""
    for path in folder.glob(f"{_STORE_PREFIX}*-*"):
        pid = path.name[len(_STORE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM to the ranks still running, then SIGKILL to those that outlive `grace_s`; a second Ctrl-C
    while waiting goes straight to SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def exit_with_launcher() -> None:
    """In a rank `launch` started: end this process if the launcher is gone (killed with SIGKILL, say),
    instead of living on, orphaned, in a collective."""
    import threading

    launcher = int(os.environ[LAUNCHED_ENV])

    def watch() -> None:
        while True:
            if os.getppid() != launcher:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="miles-launcher-watch", daemon=True).start()
