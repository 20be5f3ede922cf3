"""Host side of the code sandbox: run untrusted Python programs (model output) safely.

One call = one fresh sandbox process (`sandbox_boot.py`) that isolates itself and runs each case in a fresh child
process and a fresh, empty working directory, under CPU-time, wall-time, address-space, file-size, disk and
process-count limits, with a scrubbed environment and no network. Expected outputs never enter the sandbox: it
returns what each case printed and how it exited, and the caller judges.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BOOT_SCRIPT = str(Path(__file__).with_name("sandbox_boot.py"))
ISOLATION_MODES = ("auto", "namespaces", "process")
STARTUP_MARGIN_S = 15.0
"""Time the sandbox process may take to start and isolate itself before the host gives up on it."""
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""The whole environment a sandboxed program sees (plus HOME/TMPDIR/PWD pointing at its working directory)."""
NAMESPACES_BROKEN = threading.Event()
"""Set when namespace isolation failed after the namespaces were created (the kernel allows them, something
later does not): `auto` sandboxes in this process then use process isolation directly."""


@dataclass
class SandboxLimits:
    wall_time_s: float = 5.0
    """Per case: the case and everything it started is killed after this long."""
    cpu_time_s: float = 5.0
    """Per process: CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Per process: address space (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file a case may write (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Size of the per-case tmpfs working directory (namespace isolation only)."""
    max_processes: int = 16
    """Processes and threads a case may have at once (RLIMIT_NPROC)."""
    max_output_bytes: int = 1 << 20
    """Per stream; a case printing more is killed and fails."""
    total_time_s: float = 30.0
    """Budget for all cases of one call; cases that do not fit are reported as not run."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "total_time_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        for name in ("memory_mb", "file_size_mb", "disk_mb", "max_processes", "max_output_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ProgramCase:
    code: str
    """Python source run as `__main__`."""
    stdin: str = ""


@dataclass
class CaseResult:
    exit_code: int | None = None
    signal: int | None = None
    """The signal that killed the case (e.g. 9 after a timeout, 24 SIGXCPU past the CPU limit)."""
    timed_out: bool = False
    output_limit_exceeded: bool = False
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    cpu_s: float | None = None
    error: str | None = None
    """Set when the case did not run (sandbox failure, time budget spent)."""

    @property
    def ok(self) -> bool:
        """Ran to completion with exit status 0 inside every limit."""
        return (
            self.error is None
            and self.exit_code == 0
            and not self.timed_out
            and not self.output_limit_exceeded
        )


@dataclass
class SandboxRun:
    cases: list[CaseResult]
    isolation: dict[str, Any] = field(default_factory=dict)
    """What the sandbox achieved: mode (namespaces | process), network, filesystem, processes, uid, notes."""
    error: str | None = None
    namespaces_broken: bool = False
    """The sandbox created its namespaces but could not finish isolating itself (see NAMESPACES_BROKEN)."""


def _interpreter_paths() -> list[str]:
    return sorted({sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix})


def _site_paths() -> list[str]:
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def run_in_sandbox(
    cases: list[ProgramCase],
    limits: SandboxLimits | None = None,
    isolation: str = "auto",
    site_packages: bool = True,
) -> SandboxRun:
    """Runs each case in the sandbox; never raises for anything the programs do.

    isolation: auto (namespaces when the OS allows, else process) | namespaces (fail rather than fall back) |
    process (rlimits + audit hook only). site_packages: let programs import installed packages (numpy, ...)."""
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
    limits = limits or SandboxLimits()
    if isolation == "auto" and NAMESPACES_BROKEN.is_set():
        isolation = "process"
    run = _run_once(cases, limits, isolation, site_packages)
    if run.namespaces_broken and isolation == "auto":
        NAMESPACES_BROKEN.set()
        fallback = _run_once(cases, limits, "process", site_packages)
        fallback.isolation.setdefault("notes", []).insert(0, run.error)
        return fallback
    return run


def _reachable_temp_dir() -> str:
    """A parent for sandbox directories that the sandbox uid can traverse to."""
    default = tempfile.gettempdir()
    path = "/"
    for part in [p for p in default.split("/") if p]:
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            return "/tmp" if os.path.isdir("/tmp") else default
    return default


def _run_once(
    cases: list[ProgramCase], limits: SandboxLimits, isolation: str, site_packages: bool
) -> SandboxRun:
    root = tempfile.mkdtemp(prefix="miles-sandbox-", dir=_reachable_temp_dir())
    try:
        os.chmod(root, 0o711)  # the sandbox uid must be able to reach its working directory inside
        work_dir = os.path.join(root, "work")
        os.mkdir(work_dir, 0o711)
        job = {
            "mode": isolation,
            "work_dir": work_dir,
            "cases": [asdict(c) for c in cases],
            "limits": asdict(limits),
            "env": SANDBOX_ENV,
            "python_paths": _interpreter_paths(),
            "site_paths": _site_paths() if site_packages else [],
        }
        return _run_job(job, root, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_job(job: dict[str, Any], root: str, limits: SandboxLimits) -> SandboxRun:
    command = [sys.executable, "-I", "-S", BOOT_SCRIPT, str(os.getpid())]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(SANDBOX_ENV),
        cwd=root,
        start_new_session=True,
    )
    budget = limits.total_time_s + STARTUP_MARGIN_S + len(job["cases"]) * 0.5
    host_timeout = False
    try:
        out, err = proc.communicate(json.dumps(job).encode(), timeout=budget)
    except subprocess.TimeoutExpired:
        host_timeout = True
        _kill_group(proc.pid)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    return _parse_output(out, err, len(job["cases"]), proc.returncode, host_timeout)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parse_output(
    out: bytes, err: bytes, num_cases: int, returncode: int | None, host_timeout: bool
) -> SandboxRun:
    run = SandboxRun(
        cases=[CaseResult(error="the sandbox ended before this case ran") for _ in range(num_cases)]
    )
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "isolation" in record:
            run.isolation = record["isolation"]
        elif "error" in record:
            run.error = record["error"]
            run.namespaces_broken = bool(record.get("namespaces_broken"))
        elif "skipped" in record:
            run.cases[record["case"]] = CaseResult(error=record["skipped"])
        elif "case" in record:
            index = record.pop("case")
            run.cases[index] = CaseResult(**record)
    if run.error is None and host_timeout:
        run.error = "the sandbox process exceeded its overall time budget and was killed"
    elif run.error is None and not run.isolation:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        run.error = f"the sandbox process failed to start (exit {returncode}): {' | '.join(tail)}"
    return run


def sandbox_isolation(isolation: str = "auto") -> dict[str, Any]:
    """The isolation a sandbox achieves on this machine (runs an empty job)."""
    run = run_in_sandbox([], isolation=isolation)
    return {**run.isolation, **({"error": run.error} if run.error else {})}
