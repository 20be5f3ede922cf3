"""The `process` isolation's guards (sandbox_boot.py loads this file; standard library only): an audit hook
that refuses sockets, new processes, ctypes, writes outside the working directory and signals to other processes,
and wrappers that make the calls which raise no audit event raise one."""

from __future__ import annotations

import os
import sys
import threading
import urllib.parse

NETWORK_EVENTS = {"socket.__new__"}
PROCESS_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "subprocess.Popen",
    "pty.spawn",
}
INTROSPECTION_EVENTS = {"gc.get_objects", "gc.get_referrers", "gc.get_referents"}
PATH_WRITE_EVENTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    # event: (indices of the paths it writes, indices of the dir_fd each path is relative to, in the same order)
    "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.symlink": ((1,), (2,)),  # the link created; its target is judged when something opens through it
    # os.link: the source too, since a hard link to an outside file makes that file writable from inside
    "os.link": ((0, 1), (2, 3)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.setxattr": ((0,), ()),  # extended attributes: as root also trusted.* / security.* ones
    "os.removexattr": ((0,), ()),
    "os.mkfifo": ((0,), (1,)),  # raised by the wrappers of guard_os_calls
    "os.mknod": ((0,), (1,)),
    "shutil.rmtree": ((0,), (1,)),
    "shutil.move": ((0, 1), ()),
}
SIGNAL_EVENTS = {"os.kill", "os.killpg", "signal.pthread_kill", "os.pidfd_open"}
"""Signalling: only the case's own process (and its own process group, which holds nothing else) may be
signalled; the trainer and every other process on the machine may share the uid the case runs as."""
SQLITE_ATTACH, SQLITE_OK, SQLITE_DENY = 24, 0, 1
REIMPORT_REFUSED = {"posix", "_signal", "_sqlite3", "sqlite3", "sqlite3.dbapi2"}
"""Loaded before the case starts (sqlite3 by preload_sqlite), so an `import` event for one of them means the
program removed it from sys.modules to get a fresh copy without the wrappers of guard_os_calls / guard_sqlite."""
BLOCKED_MODULES = {"ctypes", "_ctypes", "cffi", "_posixsubprocess", "_xxsubinterpreters"}


def _path_under_fd(path: object, dir_fd: int) -> str:
    """`path` as the kernel reads it relative to the directory open as `dir_fd`."""
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))


def _resolve(path: object, dir_fd: object = None) -> str | None:
    """The real absolute path an os call would touch; None for an open descriptor, "/" when unreadable."""
    if isinstance(path, int):
        return None
    try:
        if isinstance(dir_fd, int) and dir_fd >= 0:  # audit events pass -1 for "no dir_fd"
            return os.path.realpath(_path_under_fd(path, dir_fd))
        return os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError, OSError):
        return "/"


def _outside(work_prefix: str, path: object, dir_fd: object = None) -> bool:
    resolved = _resolve(path, dir_fd)
    return resolved is not None and not (resolved + os.sep).startswith(work_prefix)


def _fd_outside(work_prefix: str, fd: int) -> bool:
    """Whether descriptor `fd` is a file outside the working directory. A descriptor opened read-only outside is
    allowed (reading is), but changing its file's metadata through it (fchmod, fsetxattr) is a write there.
    Pipes and sockets (`pipe:[N]`) are no file on disk; an unreadable descriptor counts as outside."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True
    return target.startswith("/") and not (os.path.realpath(target) + os.sep).startswith(work_prefix)


def _sqlite_file(database: object) -> str | None:
    """The file an sqlite database name (a path or a `file:` URI) opens; None for an in-memory database."""
    name = os.fsdecode(database) if isinstance(database, str | bytes | os.PathLike) else str(database)
    if name in ("", ":memory:"):
        return None
    if name[:5].lower() != "file:":
        return name
    rest, _, query = name[5:].partition("?")
    rest = rest.partition("#")[0]
    if "mode=memory" in query:
        return None
    if rest.startswith("//"):  # file://host/path: the path starts at the next slash
        slash = rest.find("/", 2)
        rest = rest[slash:] if slash >= 0 else ""
    path = urllib.parse.unquote(rest)
    return None if path in ("", ":memory:") else path


_SQLITE_CONNECTING = threading.local()
"""Set while the guarded sqlite3.connect runs: a Connection built any other way would lack the ATTACH guard."""


def audit_hook(work_dir: str):  # noqa: ANN202 - returns a closure handed to sys.addaudithook
    work_prefix = os.path.realpath(work_dir) + os.sep
    own_pid = os.getpid()
    own_proc = f"/proc/{own_pid}/"

    def other_process(path: object) -> bool:
        resolved = _resolve(path)
        if resolved is None or not resolved.startswith("/proc/"):
            return False
        first = resolved.split("/")[2]
        return first.isdigit() and not (resolved + "/").startswith(own_proc)

    def signal_refusal(event: str, target: int) -> str | None:
        if event == "os.kill":  # 0 and -pid: its own process group (it runs in a session of its own)
            allowed = target in (own_pid, 0, -own_pid)
        elif event == "os.killpg":
            allowed = target in (0, os.getpgrp())
        elif event == "signal.pthread_kill":
            allowed = target in {t.ident for t in threading.enumerate()}
        else:  # os.pidfd_open: a descriptor to signal a process through, without os.kill
            allowed = target == own_pid
        return None if allowed else f"signalling another process ({event} {target})"

    def sqlite_refusal(event: str, args: tuple) -> str | None:
        if event == "sqlite3.connect":
            if not getattr(_SQLITE_CONNECTING, "active", False):
                return "building an sqlite3.Connection directly (use sqlite3.connect)"
            file = _sqlite_file(args[0])
            if file is not None and _outside(work_prefix, file):
                return f"opening sqlite database {file} (outside the working directory)"
            return None
        if event == "sqlite3.load_extension" or (event == "sqlite3.enable_load_extension" and args[1]):
            return "loading an sqlite extension (C code)"
        return None

    def write_refusal(event: str, args: tuple) -> str | None:
        path_indices, fd_indices = PATH_WRITE_EVENTS[event]
        for position, index in enumerate(path_indices):
            if index >= len(args):
                continue
            fd_index = fd_indices[position] if position < len(fd_indices) else len(args)
            dir_fd = args[fd_index] if fd_index < len(args) else None
            path = args[index]
            if isinstance(path, int) and not isinstance(path, bool) and path >= 0:
                if _fd_outside(work_prefix, path):
                    return f"{event} on descriptor {path} (a file outside the working directory)"
                continue
            if _outside(work_prefix, path, dir_fd):
                return f"{event} on {args[index]} (outside the working directory)"
        return None

    def refusal(event: str, args: tuple) -> str | None:
        if event in NETWORK_EVENTS:
            return (
                "opening a network socket" if len(args) > 1 and args[1] != 1 else None
            )  # AF_UNIX (1) stays allowed
        if event in PROCESS_EVENTS:
            return f"starting a process ({event})"
        if event in SIGNAL_EVENTS:
            return signal_refusal(event, args[0])
        if event in INTROSPECTION_EVENTS:
            return f"heap introspection ({event})"
        if event.startswith("ctypes."):
            return "calling C code through ctypes"
        if event.startswith("sqlite3."):
            return sqlite_refusal(event, args)
        if event == "import":
            root = args[0].split(".")[0]
            return f"importing {args[0]}" if root in BLOCKED_MODULES or args[0] in REIMPORT_REFUSED else None
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int)
                and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            )
            if path is not None and other_process(path):
                return f"reading another process's {path}"
            return (
                f"writing {path} (outside the working directory)"
                if writing and _outside(work_prefix, path)
                else None
            )
        if event in PATH_WRITE_EVENTS:
            return write_refusal(event, args)
        return None

    def hook(event: str, args: tuple) -> None:
        reason = refusal(event, args)
        if reason is not None:
            raise PermissionError(f"sandbox: {reason} is not allowed")

    return hook


def _audited(original, event: str):  # noqa: ANN001, ANN202 - wraps a posix function
    def call(path, *args, dir_fd=None, **kwargs):  # noqa: ANN001, ANN202
        sys.audit(event, path, -1 if dir_fd is None else dir_fd)
        return original(path, *args, dir_fd=dir_fd, **kwargs)

    return call


def guard_os_calls() -> None:
    """In `os` and `posix` alike: `os.open`'s audit event carries no dir_fd, so a dir_fd-relative path is turned
    into the absolute path the kernel would open (which the hook then judges); mkfifo / mknod / pidfd_open raise
    no event, so their wrappers raise one."""
    posix = sys.modules["posix"]
    original_open = posix.open

    def guarded_open(path, flags, mode=0o777, *, dir_fd=None):  # noqa: ANN001, ANN202 - os.open's signature
        if dir_fd is not None and not isinstance(path, int):
            path, dir_fd = _path_under_fd(path, dir_fd), None
        return original_open(path, flags, mode, dir_fd=dir_fd)

    wrappers = {"open": guarded_open}
    for name in ("mkfifo", "mknod"):
        if hasattr(posix, name):
            wrappers[name] = _audited(getattr(posix, name), f"os.{name}")
    if hasattr(posix, "pidfd_open"):
        original_pidfd_open = posix.pidfd_open

        def guarded_pidfd_open(pid, flags=0):  # noqa: ANN001, ANN202 - os.pidfd_open's signature
            sys.audit("os.pidfd_open", pid)
            return original_pidfd_open(pid, flags)

        wrappers["pidfd_open"] = guarded_pidfd_open
    for name, wrapper in wrappers.items():
        setattr(posix, name, wrapper)
        setattr(os, name, wrapper)


def guard_sqlite(work_dir: str) -> None:
    """sqlite3.connect (preloaded by the process-mode sandbox) gets an authorizer refusing ATTACH / VACUUM INTO of
    files outside the working directory: SQL names files the audit hook never sees."""
    sqlite = sys.modules.get("_sqlite3")
    if sqlite is None:
        return
    work_prefix = os.path.realpath(work_dir) + os.sep
    original_connect = sqlite.connect

    def attach_guard(action: int, arg1: object, *_: object) -> int:
        if action == SQLITE_ATTACH:
            file = _sqlite_file(arg1 or "")
            if file is not None and _outside(work_prefix, file):
                return SQLITE_DENY
        return SQLITE_OK

    def guarded_connect(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - sqlite3.connect's signature
        _SQLITE_CONNECTING.active = True
        try:
            connection = original_connect(*args, **kwargs)
        finally:
            _SQLITE_CONNECTING.active = False
        connection.set_authorizer(attach_guard)
        return connection

    for name in ("_sqlite3", "sqlite3", "sqlite3.dbapi2"):
        module = sys.modules.get(name)
        if module is not None:
            module.connect = guarded_connect


def preload_sqlite() -> None:
    """Process mode: import sqlite3 once in the sandbox process, so each case (forked from it) starts with the
    guarded connect of guard_sqlite, and a fresh import of it can be refused (REIMPORT_REFUSED)."""
    try:
        import sqlite3  # noqa: F401
    except ImportError:  # an interpreter built without sqlite: nothing to guard
        pass
