"""`LineAppender`: appends lines to a run file so that a full disk loses none of them.

A write that fails (ENOSPC, EDQUOT, an I/O error) keeps its bytes, and the next write or `close` tries them again
first: once the disk has room the file is complete, each line once and in order. The failure is logged once (and
the recovery once), never raised: a run's records must not be what stops it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger("miles.tracking")


class _Writable(Protocol):
    def write(self, data: bytes, /) -> int | None: ...

    def close(self) -> None: ...


class LineAppender:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: _Writable = open(path, "ab", buffering=0)  # unbuffered: a failed write keeps no bytes here
        self._pending = b""
        self._failing = False

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def write(self, line: str) -> bool:
        """Appends `line` (after what earlier failures left); whether everything is on disk now."""
        self._pending += line.encode()
        return self.flush()

    def flush(self) -> bool:
        while self._pending:
            try:
                written = self.file.write(self._pending)
                if not written:  # nothing taken (never for a regular file): later, rather than spin here
                    raise OSError("the file took no bytes")
            except OSError as e:
                if not self._failing:
                    log.error(
                        "could not write to %s (%s); its records are kept in memory and written once there is "
                        "room again (free some disk space)",
                        self.path,
                        e,
                    )
                self._failing = True
                return False
            self._pending = self._pending[written:]  # a short write: the disk filled up mid-line
        if self._failing:
            log.warning("%s is complete again: the records a full disk held back are written", self.path)
            self._failing = False
        return True

    def close(self) -> None:
        if not self.flush():
            log.error(
                "%s is missing its last %d bytes: the disk stayed full until the end of the run",
                self.path,
                len(self._pending),
            )
        self.file.close()
