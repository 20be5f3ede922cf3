"""Finding and killing the processes a reward left behind (Linux; elsewhere these find nothing).

A reward worker is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process a reward started that outlives
its parent (a double fork into a session of its own: a daemon) is re-parented to the worker instead of to init,
so it stays in the worker's tree of descendants, where `descendants` finds it and `kill_all` ends it.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants; whether the kernel agreed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux, or no prctl
        return False


def _has_children_files() -> bool:
    """Whether the kernel lists children in /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)."""
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def _children(pid: int) -> list[int]:
    """Children of `pid`, from its threads' /proc children files ([] once it is gone)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return found


def _parents() -> dict[int, list[int]]:
    """Every process's children, from one scan of /proc/*/stat (where there are no children files)."""
    children: dict[int, list[int]] = defaultdict(list)
    if not Path("/proc").is_dir():  # not Linux: nothing is found, the process group kill still applies
        return children
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
        children[ppid].append(int(entry.name))
    return children


def descendants(pid: int, prune: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Every process below `pid` in the process tree (children, theirs, ...), as found now; the processes in
    `prune` and everything below them are left out."""
    if _has_children_files():
        children_of = _children
    else:
        tree = _parents()

        def children_of(p: int) -> list[int]:
            return tree.get(p, [])

    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children_of(queue.pop()):
            if child not in found and child not in prune:
                found.append(child)
                queue.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILLs each pid (one already gone is skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def reap_children(pid: int, keep: set[int]) -> None:
    """Collects the exited children of `pid` (this process) that are not in `keep`: killed leftovers, orphans it
    inherited as subreaper. A child of `keep` (a reward's own helper) is left to the reward, whose Popen would
    otherwise lose its exit status. One still dying is collected next time; a zombie holds no memory."""
    children = _children(pid) if _has_children_files() else _parents().get(pid, [])
    for child in children:
        if child in keep:
            continue
        try:
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:  # not ours to wait for, or collected already
            pass
