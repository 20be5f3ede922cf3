"""A control channel between the two sides of a sync: one end of a `multiprocessing` Pipe, with the name of
the side at the other end and a timeout, so a side that stops answering is named in the error."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch.multiprocessing  # noqa: F401  (registers the picklers that send shared tensors as handles)

from miles.weight_sync.protocol import ChannelClosed, Failed, SyncError, SyncRefused, SyncTimeout

M = TypeVar("M")


class Channel:
    def __init__(self, conn: Connection, peer: str, timeout_s: float = 300.0) -> None:
        """`peer`: the other side, as errors should name it ("engine-0 (pid 4242)", "the trainer")."""
        self.conn, self.peer, self.timeout_s = conn, peer, float(timeout_s)

    def send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as err:
            raise ChannelClosed(f"{self.peer} closed the channel (did its process end?): {err}") from err

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self.conn.poll(timeout_s)

    def recv(self, waiting_for: str, timeout_s: float | None = None) -> Any:
        """The next message; SyncTimeout naming the peer when none comes within the timeout (the channel's
        own unless given; `float('inf')` waits for ever)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        try:
            ready = self.conn.poll(None if timeout == float("inf") else timeout)
        except (EOFError, OSError) as err:
            raise ChannelClosed(
                f"{self.peer} closed the channel (did its process end?) while {waiting_for}"
            ) from err
        if not ready:
            raise SyncTimeout(
                f"{self.peer} did not answer within {time.monotonic() - started:.1f} s while {waiting_for}: it is "
                "hung or dead (raise weight_sync.timeout_s if it is only slow)"
            )
        try:
            return self.conn.recv()
        except (EOFError, OSError) as err:
            raise ChannelClosed(
                f"{self.peer} closed the channel (did its process end?) while {waiting_for}"
            ) from err

    def expect(self, kind: type[M], waiting_for: str, timeout_s: float | None = None) -> M:
        """The next message, which must be a `kind`; a `Failed` from the peer is raised as its error."""
        message = self.recv(waiting_for, timeout_s)
        if isinstance(message, Failed):
            error = SyncRefused if message.refused else SyncError
            raise error(f"{message.engine}: {message.error}")
        if not isinstance(message, kind):
            raise SyncError(
                f"{self.peer} sent {type(message).__name__} while {waiting_for} (expected {kind.__name__}): the "
                "two sides disagree about the protocol; reconnect the transport"
            )
        return message

    def close(self) -> None:
        self.conn.close()
