"""An engine as a Ray actor: the actor builds its `Engine` and runs the engine process's serve loop
(engine_process.py) on two sockets, one for the driver's commands and one for the weight syncs of the trainer
rank that feeds it. The driver talks to it through an `EngineProcess` attached to the command socket, so a
generate call, a sync landing between engine steps and a dead engine behave as with a spawned engine process.

    actor = remote_class().options(**actor_options(...)).remote("engine-0", authkey, host, timeout_s)
    commands, sync = ray.get(actor.start.remote(spec))
    connecting = trainer_rank.connect_sync.remote(0, sync, "shm", ...)
    engine = connect_engine(actor, commands, "engine-0", authkey, timeout_s, hang_s, connecting)
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from miles.placement.engine_process import EngineProcess, EngineSpec, Heartbeat, serve
from miles.placement.ray.cluster import bind_host, use_authkey

log = logging.getLogger("miles.placement")


class EngineServer:
    """The actor's body (`EngineActor` is this class made a Ray actor)."""

    def __init__(self, name: str, authkey: bytes, host: str, timeout_s: float) -> None:
        use_authkey(authkey)
        self.name, self.timeout_s = name, timeout_s
        self.heartbeat = Heartbeat()
        self._commands = Listener((bind_host(host), 0), authkey=authkey)
        self._sync = Listener((bind_host(host), 0), authkey=authkey)
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._next_syncs: queue.Queue[Connection] = queue.Queue()

    def start(self, spec: EngineSpec) -> tuple[Any, Any]:
        """Build the engine from `spec` and serve it (in a thread, once the driver and the syncing trainer
        rank connected); returns where they connect: (commands, sync)."""
        self._thread = threading.Thread(
            target=self._run, args=(spec,), name=f"miles-{self.name}", daemon=True
        )
        self._thread.start()
        return self._commands.address, self._sync.address

    def ping(self) -> dict[str, Any]:
        """The health check: the process answers, and whether its serve loop is stuck with requests waiting."""
        return {
            "pid": os.getpid(),
            "serving": self._thread is not None and self._thread.is_alive(),
            "busy": self.heartbeat.busy,
            "stalled_s": self.heartbeat.stalled_for(),
            "error": self.error,
        }

    def _run(self, spec: EngineSpec) -> None:
        try:
            commands = self._commands.accept()  # the driver first, then the trainer rank
            sync = self._sync.accept()
            threading.Thread(target=self._accept_syncs, name=f"miles-{self.name}-sync", daemon=True).start()
            serve(spec, self.name, commands, sync, self.timeout_s, self.heartbeat, self._next_sync)
        except BaseException as err:
            self.error = f"{type(err).__name__}: {err}"
            log.exception("%s stopped", self.name)
        finally:
            self._commands.close()
            self._sync.close()

    def _accept_syncs(self) -> None:
        """The trainer rank's later connections (it reconnects when it rebuilds its sender), queued for the
        serve loop, which goes on serving commands meanwhile."""
        while True:
            try:
                self._next_syncs.put(self._sync.accept())
            except OSError:  # the listener closed: the engine stopped
                return

    def _next_sync(self) -> Connection | None:
        try:
            return self._next_syncs.get_nowait()
        except queue.Empty:
            return None


class ActorProcess:
    """A Ray engine actor behind the process interface `EngineProcess` checks liveness through."""

    def __init__(self, actor: Any, name: str, hang_s: float = float("inf"), watch: Any = None) -> None:
        """`watch`: a Ray call the engine depends on (its trainer rank connecting to it); the engine counts
        as dead once that call failed."""
        import ray

        self.actor, self.name, self.hang_s, self.watch = actor, name, hang_s, watch
        self.pid = ray.get(actor.ping.remote())["pid"]
        self.exitcode: int | None = None
        self.why_dead = ""

    def is_alive(self) -> bool:
        if self.exitcode is not None:
            return False
        import ray

        if self.watch is not None and ray.wait([self.watch], timeout=0)[0]:
            try:
                ray.get(self.watch)
            except ray.exceptions.RayError as err:
                self.why_dead = f"its trainer rank could not connect to it ({type(err).__name__})"
                self.terminate()
                return False
            self.watch = None
        try:
            # The ping runs on another of the actor's threads: it answers while the engine steps.
            health = ray.get(self.actor.ping.remote(), timeout=max(5.0, min(30.0, self.hang_s)))
        except Exception as err:  # RayActorError (died), GetTimeoutError (the process no longer answers)
            self.why_dead = f"its actor is gone ({type(err).__name__})"
        else:
            if health["serving"] and health["stalled_s"] <= self.hang_s:
                return True
            if health["serving"]:
                self.why_dead = f"it made no engine step for {health['stalled_s']:.0f} s (hung); killed it"
            else:
                self.why_dead = f"its serve loop ended: {health['error']}"
        self.terminate()
        return False

    def join(self, timeout: float | None = None) -> None:
        self.terminate()  # after Stop the serve loop has returned; the actor holds nothing else

    def terminate(self) -> None:
        import ray

        if self.exitcode is None:
            ray.kill(self.actor, no_restart=True)
            self.exitcode = -9


def connect_engine(
    actor: Any,
    commands_address: Any,
    name: str,
    authkey: bytes,
    timeout_s: float,
    hang_s: float,
    watch: Any = None,
) -> EngineProcess:
    """The driver's `EngineProcess` over the started actor's command socket (waits for the engine to be
    built; `watch`: the trainer rank's connecting call, which the engine waits for)."""
    commands: Connection = _connect(commands_address, authkey, timeout_s)
    process = EngineProcess(EngineSpec(), name=name, timeout_s=timeout_s)
    return process.attach(ActorProcess(actor, name, hang_s, watch), commands)


def _connect(address: Any, authkey: bytes, timeout_s: float) -> Connection:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def remote_class() -> Any:
    """`EngineServer` as a Ray actor class (made on first use: Ray is an optional dependency)."""
    import ray

    return ray.remote(max_restarts=0, max_concurrency=4)(EngineServer)
