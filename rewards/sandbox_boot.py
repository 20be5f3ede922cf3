"""The inside of the code sandbox (see sandbox.py for the host side and docs/rewards.md for the threat model).

Started as `python -I -S sandbox_boot.py PARENT_PID` with a JSON job on stdin; prints one JSON line describing the
isolation it achieved, then one JSON line per case. Standard library only, so it starts fast and never imports the
trainer's environment. Each case runs in a fresh child process (forked from this small interpreter, so there is
no interpreter start-up per case) in a fresh, empty working directory.

Isolation, strongest first:
- `namespaces`: new mount, network, pid, ipc and uts namespaces (plus a user namespace when not root). The whole
  file tree is remounted read-only and nosuid; the working directory is a size-limited tmpfs; the network
  namespace has only a loopback device that is down; the case runs as pid >= 2 under an init that kills every
  process in the namespace after each case; as root, cases run under a throw-away uid (so RLIMIT_NPROC applies),
  otherwise with every capability dropped.
- `process` (fallback when namespaces are refused): resource limits, its own session killed as a group, and an
  audit hook that refuses sockets, new processes, ctypes, writes outside the working directory (dir_fd-relative
  ones, sqlite databases, extended attributes and metadata changes through a descriptor included), reading other processes' /proc files and signalling other processes. What
  raises no audit event (`os.open`'s dir_fd, mkfifo / mknod, pidfd_open) is wrapped so that it does. That hook is
  Python-level: it stops ordinary programs, not a determined attacker.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import threading
import time
import traceback
import types

_libc = ctypes.CDLL(None, use_errno=True)

# The guards live beside this file; `python -I` puts no script folder on sys.path, so it is added for this import.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    from sandbox_audit import BLOCKED_MODULES, audit_hook, guard_os_calls, guard_sqlite, preload_sqlite
finally:
    del sys.path[0]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR = 442  # the same on every architecture (new syscalls share one table since Linux 5.1)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SANDBOX_UID_BASE = 1_000_000
"""As root, cases run as uid/gid SANDBOX_UID_BASE + this process's pid: unique among concurrent sandboxes, so each
sandbox's RLIMIT_NPROC budget is its own."""


# --- thin libc wrappers -------------------------------------------------------------------------------------------


def _encode(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    zero = ctypes.c_ulong(0)
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), zero, zero, zero), f"prctl({option})")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    ret = _libc.mount(_encode(source), _encode(target), _encode(fstype), ctypes.c_ulong(flags), _encode(data))
    _check(ret, f"mount {target}")


def _umount(target: str) -> None:
    _check(_libc.umount2(_encode(target), ctypes.c_int(MNT_DETACH)), f"umount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _mount_setattr(path: str, flags: int, attr_set: int) -> None:
    attr = _MountAttr(attr_set, 0, 0, 0)
    ret = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        _encode(path),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, f"mount_setattr {path}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities() -> None:
    header, data = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _emit(record: dict) -> None:
    _write_all(1, (json.dumps(record) + "\n").encode())


# --- isolation setup (runs in this process before any case) ---------------------------------------------------------


class Isolation:
    """What this sandbox achieved; printed as the first line so the host can report it."""

    def __init__(self) -> None:
        self.mode = "process"
        self.network = "audit-hook"
        self.filesystem = "audit-hook"
        self.processes = "rlimit+session-kill"
        self.run_uid = os.getuid()
        self.drop_to_uid: int | None = None  # root: the throw-away uid cases run as
        self.notes: list[str] = []

    def record(self) -> dict:
        return {
            "isolation": {
                "mode": self.mode,
                "network": self.network,
                "filesystem": self.filesystem,
                "processes": self.processes,
                "uid": self.run_uid,
                "notes": self.notes,
            }
        }


def _others_can_enter(path: str) -> bool:
    return bool(os.stat(path).st_mode & 0o001)


def _first_closed_dir(path: str) -> str | None:
    """The outermost directory on the way to `path` that users outside its owner/group cannot enter."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        if not _others_can_enter(current):
            return current
        current = os.path.join(current, part)
    return None if _others_can_enter(current) else current


def _minimal_roots(paths: list[str]) -> list[str]:
    roots: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)}):
        if not any(path == r or path.startswith(r + "/") for r in roots):
            roots.append(path)
    return roots


def _python_reachable_by_others(paths: list[str]) -> bool:
    return all(_first_closed_dir(p) is None for p in _minimal_roots(paths))


def _expose_python(paths: list[str], staging_dir: str) -> list[str]:
    """Root only: cases run as an unprivileged uid that must still read the interpreter's files. Any closed directory
    on the way to them (e.g. /root, mode 700, holding a pyenv) is covered with an empty tmpfs in this mount namespace
    and only the interpreter's trees are bound back into it, which also hides the rest of that directory."""
    plan = [(p, _first_closed_dir(p)) for p in _minimal_roots(paths)]
    plan = [(p, closed) for p, closed in plan if closed is not None]
    if not plan:
        return []
    if any(p == closed for p, closed in plan):
        raise OSError(f"the interpreter tree itself is not readable by other users: {plan}")
    covers = sorted({closed for _, closed in plan})
    covers = [c for c in covers if not any(c != o and c.startswith(o + "/") for o in covers)]
    staged = []
    for index, (path, _) in enumerate(plan):
        stage = os.path.join(staging_dir, f".stage{index}")
        os.mkdir(stage, 0o700)
        _mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((path, stage))
    for cover in covers:
        _mount("tmpfs", cover, "tmpfs", MS_NOSUID, "mode=0755,size=1m")
    for path, stage in staged:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(stage, path, None, MS_BIND | MS_REC)
        _umount(stage)
    return covers


def _make_tree_read_only(isolation: Isolation) -> None:
    try:
        _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
        return
    except OSError as e:
        isolation.notes.append(f"mount_setattr unavailable ({e.strerror}); remounting mounts one by one")
    with open("/proc/self/mountinfo") as f:
        targets = sorted({line.split()[4] for line in f}, key=len)
    for target in targets:
        try:
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError as e:
            isolation.notes.append(f"could not make {target} read-only: {e.strerror}")


class SetupError(Exception):
    """Isolation failed after the namespaces were created: this process is half set up and must not run cases."""


def enter_namespaces(job: dict, isolation: Isolation) -> None:
    """Raises OSError when the kernel or the container refuses the namespaces (nothing changed yet: the caller may
    fall back), SetupError when a later step fails."""
    uid, gid = os.getuid(), os.getgid()
    is_root = uid == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _unshare(flags if is_root else flags | CLONE_NEWUSER)
    try:
        _isolate_inside(job, isolation, uid, gid)
    except OSError as e:
        raise SetupError(str(e)) from e


def _isolate_inside(job: dict, isolation: Isolation, uid: int, gid: int) -> None:
    is_root = uid == 0
    if not is_root:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    if is_root:
        isolation.drop_to_uid = SANDBOX_UID_BASE + os.getpid()
        covered = _expose_python(job["python_paths"], job["work_dir"])
        if covered:
            isolation.notes.append(f"covered {covered} with a tmpfs holding only the interpreter")
    _make_tree_read_only(isolation)
    isolation.mode = "namespaces"
    isolation.network = "netns (loopback down)"
    isolation.filesystem = "read-only tree + per-case tmpfs"
    isolation.processes = "pidns + rlimit"
    isolation.run_uid = isolation.drop_to_uid if is_root else uid


# --- one case -------------------------------------------------------------------------------------------------------


def _set_limits(limits: dict, extra_processes: int) -> None:
    cpu = max(1, int(limits["cpu_time_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    procs = limits["max_processes"] + extra_processes
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
    memory = limits["memory_mb"] << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        memory = min(memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def _run_user_code(code: str, path: str) -> int:
    """Runs the program as `__main__` in this (forked) interpreter; returns its exit code."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=__builtins__)
    sys.modules["__main__"] = module
    sys.argv = [path]
    exit_code = 0
    try:
        exec(compile(code, path, "exec"), module.__dict__)
    except SystemExit as e:
        if e.code is None:
            exit_code = 0
        elif isinstance(e.code, int):
            exit_code = e.code
        else:
            print(e.code, file=sys.stderr)
            exit_code = 1
    except BaseException as e:  # the program's own uncaught error: report it like the interpreter would
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        exit_code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    return exit_code


def _case_child(
    job: dict, case: dict, isolation: Isolation, fds: tuple[int, int, int], work_dir: str
) -> None:
    """In the forked child: drop privileges, apply limits, run the program. Never returns."""
    exit_code = 125
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(work_dir)
        main_path = os.path.join(work_dir, "main.py")
        with open(main_path, "w") as f:
            f.write(case["code"])
        os.chmod(main_path, 0o644)
        os.environ.clear()
        os.environ.update(job["env"], HOME=work_dir, TMPDIR=work_dir, PWD=work_dir)
        if isolation.drop_to_uid is not None:
            os.setgroups([])
            os.setresgid(isolation.drop_to_uid, isolation.drop_to_uid, isolation.drop_to_uid)
            os.setresuid(isolation.drop_to_uid, isolation.drop_to_uid, isolation.drop_to_uid)
        if isolation.mode == "namespaces":
            _drop_capabilities()
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.path[:0] = [work_dir, *job["site_paths"]]
        if isolation.mode != "namespaces":
            for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED_MODULES]:
                del sys.modules[name]
            guard_os_calls()
            guard_sqlite(work_dir)
            sys.addaudithook(audit_hook(work_dir))
        supervisors = 2 if isolation.mode == "namespaces" and isolation.drop_to_uid is None else 0
        _set_limits(job["limits"], supervisors)
    except BaseException as e:  # setup failed: the case must not run with weaker isolation than reported
        os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        os._exit(125)
    try:
        exit_code = _run_user_code(case["code"], main_path)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # a closed or broken pipe must not change the exit code
                pass
        os._exit(exit_code & 0xFF)


def _fresh_work_dir(job: dict, isolation: Isolation, index: int) -> str:
    if isolation.mode == "namespaces":
        work_dir = job["work_dir"]
        uid = isolation.run_uid
        gid = os.getgid() if isolation.drop_to_uid is None else isolation.drop_to_uid
        options = f"size={job['limits']['disk_mb']}m,nr_inodes=4096,mode=0700,uid={uid},gid={gid}"
        _mount("tmpfs", work_dir, "tmpfs", MS_NOSUID | MS_NODEV, options)
        return work_dir
    work_dir = os.path.join(job["work_dir"], f"case{index}")
    os.mkdir(work_dir, 0o700)
    if isolation.drop_to_uid is not None:
        os.chown(work_dir, isolation.drop_to_uid, isolation.drop_to_uid)
    return work_dir


def _kill_rest(pid: int, isolation: Isolation) -> None:
    """Kills whatever the case left behind (its children, daemons, a fork bomb)."""
    if isolation.mode == "namespaces" and os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)  # as the namespace's init: every other process in the sandbox
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _CaseWatch:
    """The parent's side of one running case: feeds its stdin, captures its output (up to a cap), notices its exit
    (through a pidfd when the kernel has them) and its deadline."""

    def __init__(self, pid: int, stdin_w: int, stdout_r: int, stderr_r: int, stdin: bytes, cap: int) -> None:
        self.pid, self.cap = pid, cap
        self.stdin_w, self.stdin = stdin_w, memoryview(stdin)
        self.captured = {stdout_r: bytearray(), stderr_r: bytearray()}
        self.open_pipes = set(self.captured)
        self.status: int | None = None
        self.rusage = None
        self.output_limit = False
        self.poller = select.poll()
        for fd in self.captured:
            self.poller.register(fd, select.POLLIN)
        os.set_blocking(stdin_w, False)
        self.stdin_polled = bool(self.stdin)
        if self.stdin_polled:
            self.poller.register(stdin_w, select.POLLOUT)
        else:
            self._close_stdin()
        try:
            self.pidfd = os.pidfd_open(pid)
            self.poller.register(self.pidfd, select.POLLIN)
        except (AttributeError, OSError):
            self.pidfd = -1

    def _close_stdin(self) -> None:
        if self.stdin_w >= 0:
            if self.stdin_polled:
                self.poller.unregister(self.stdin_w)
                self.stdin_polled = False
            os.close(self.stdin_w)
            self.stdin_w = -1

    def _reap_if_exited(self) -> None:
        waited, status, usage = os.wait4(self.pid, os.WNOHANG)
        if waited == self.pid:
            self.status, self.rusage = status, usage

    def _feed_stdin(self, event: int) -> None:
        if not event & (select.POLLERR | select.POLLHUP):
            try:
                self.stdin = self.stdin[os.write(self.stdin_w, self.stdin[:65536]) :]
                if self.stdin:
                    return
            except BlockingIOError:
                return
            except BrokenPipeError:  # the program stopped reading: fine
                pass
        self._close_stdin()

    def _read(self, fd: int) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            self.poller.unregister(fd)
            self.open_pipes.discard(fd)
            return
        self.captured[fd] += chunk
        self.output_limit |= len(self.captured[fd]) > self.cap

    def run(self, deadline: float) -> bool:
        """Until the case exited and its pipes are drained; False when the deadline or the output cap hit first."""
        while self.status is None or self.open_pipes:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.output_limit:
                return self.status is not None and not self.output_limit
            if self.status is not None or self.pidfd < 0:
                # exited: drain what is buffered, never wait on a pipe a grandchild holds; no pidfd: poll for exit
                remaining = min(remaining, 0.05)
            events = self.poller.poll(remaining * 1000)
            if not events and self.status is not None:
                break
            for fd, event in events:
                if fd == self.pidfd:
                    self.poller.unregister(fd)
                    os.close(fd)
                    self.pidfd = -1
                    self._reap_if_exited()
                elif fd == self.stdin_w:
                    self._feed_stdin(event)
                else:
                    self._read(fd)
            if self.pidfd < 0 and self.status is None:
                self._reap_if_exited()
        return not self.output_limit

    def close(self) -> None:
        self._close_stdin()
        for fd in [*self.captured, self.pidfd]:
            if fd >= 0:
                os.close(fd)

    def text(self, fd_index: int) -> str:
        data = list(self.captured.values())[fd_index]
        return bytes(data[: self.cap]).decode("utf-8", "replace")


def run_case(job: dict, case: dict, index: int, isolation: Isolation, wall_time_s: float) -> dict:
    work_dir = _fresh_work_dir(job, isolation, index)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _case_child(job, case, isolation, (in_r, out_w, err_w), work_dir)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    watch = _CaseWatch(
        pid, in_w, out_r, err_r, case.get("stdin", "").encode(), job["limits"]["max_output_bytes"]
    )
    watch.run(start + wall_time_s)
    timed_out = watch.status is None and not watch.output_limit
    if watch.status is None:
        os.kill(pid, signal.SIGKILL)  # the case itself first, so its own status can still be collected
        _, watch.status, watch.rusage = os.wait4(pid, 0)
    _kill_rest(pid, isolation)
    watch.close()
    if isolation.mode == "namespaces":
        _umount(work_dir)
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    code = os.waitstatus_to_exitcode(watch.status)
    return {
        "case": index,
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "timed_out": timed_out,
        "output_limit_exceeded": watch.output_limit,
        "stdout": watch.text(0),
        "stderr": watch.text(1),
        "seconds": round(time.monotonic() - start, 4),
        "cpu_s": round(watch.rusage.ru_utime + watch.rusage.ru_stime, 4) if watch.rusage else None,
    }


def run_cases(job: dict, isolation: Isolation) -> None:
    if isolation.mode == "namespaces":
        try:
            _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            isolation.notes.append(
                f"kept the host /proc ({e.strerror}); other users' processes stay unreadable"
            )
    _emit(isolation.record())
    deadline = time.monotonic() + job["limits"]["total_time_s"]
    for index, case in enumerate(job["cases"]):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _emit({"case": index, "skipped": "the sandbox's total time budget ran out"})
            continue
        _emit(run_case(job, case, index, isolation, min(job["limits"]["wall_time_s"], remaining)))


def main() -> int:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[1]):
        return 1  # the host died before the death signal was armed
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    job = json.loads(b"".join(chunks))
    isolation = Isolation()
    if job["mode"] in ("auto", "namespaces"):
        try:
            enter_namespaces(job, isolation)
        except SetupError as e:
            _emit({"error": f"namespace setup failed: {e}", "namespaces_broken": True})
            return 3
        except OSError as e:
            if job["mode"] == "namespaces":
                _emit({"error": f"namespace isolation was required but is unavailable: {e}"})
                return 3
            isolation = Isolation()
            isolation.notes.append(f"namespaces unavailable ({e}); using process isolation")
    if isolation.mode == "process" and os.getuid() == 0:
        if _python_reachable_by_others(job["python_paths"]):
            isolation.drop_to_uid = isolation.run_uid = SANDBOX_UID_BASE + os.getpid()
        else:
            isolation.notes.append(
                "cases run as root (the interpreter is not readable by other users), so "
                "RLIMIT_NPROC is not enforced; the audit hook refuses new processes instead"
            )
    if isolation.mode == "process":
        preload_sqlite()
        run_cases(job, isolation)
        return 0
    init = (
        os.fork()
    )  # the first child in the new pid namespace is its init: when it exits, the kernel kills the rest
    if init == 0:
        code = 0
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            run_cases(job, isolation)
        except BaseException as e:  # report, never hang the host
            _emit({"error": f"sandbox init failed: {e!r}"})
            code = 4
        os._exit(code)
    _, status = os.waitpid(init, 0)
    return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(main())
