"""Rewards that do what untrusted code does (exit, signal, segfault, allocate, fork, daemonize, hang), chosen by
the sample's response. The pid of a process one of them leaves running goes to `<label>/pids` for the test."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from miles.sample import Sample


def _record(folder: str, pid: int) -> None:
    with open(Path(folder) / "pids", "a") as f:
        f.write(f"{pid}\n")


def hostile(sample: Sample, **_: object) -> dict:
    action = sample.response_text
    if action == "exit":
        os._exit(3)
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if action == "allocate":
        block = bytearray(3 << 30)  # past a 512 MB cap
        return {"score": 1.0, "size": len(block)}
    if action == "fork":
        child = os.fork()
        if child == 0:  # the child stays behind, sleeping
            time.sleep(600)
            os._exit(0)
        _record(sample.label, child)
        return {"score": 1.0, "pid": os.getpid()}
    if action == "daemon":  # double fork into a session of its own: escapes the worker's process group
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write_end, f"{os.getpid()}\n".encode())
                time.sleep(600)
            os._exit(0)
        os.waitpid(child, 0)
        _record(sample.label, int(os.read(read_end, 64).decode()))
        return {"score": 1.0, "pid": os.getpid()}
    if action == "fork_returns":  # the forked copy returns too: it must not answer on the worker's pipe
        os.fork()
        return {"score": 1.0, "pid": os.getpid()}
    if action == "hang":
        time.sleep(600)
    return {"score": 1.0, "pid": os.getpid()}


async def async_pid(sample: Sample, **_: object) -> dict:
    await asyncio.sleep(0.3)
    return {"score": 1.0, "pid": os.getpid()}


class KeepsAHelper:
    """Starts a helper process once, in its constructor (a checker kept warm), and uses it in every call."""

    def __init__(self) -> None:
        import subprocess

        self.helper = subprocess.Popen(["sleep", "60"])

    def __call__(self, sample: Sample) -> dict:
        return {"score": float(self.helper.poll() is None), "helper": self.helper.pid}

    def close(self) -> None:
        self.helper.kill()


async def async_batched(samples: list[Sample], **_: object) -> list[dict]:
    await asyncio.sleep(0.05)
    return [{"score": float(i), "pid": os.getpid()} for i in range(len(samples))]
