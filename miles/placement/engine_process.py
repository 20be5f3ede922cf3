"""An engine in a process of its own, spawned by the trainer side: `EngineProcess(spec).start()`.

The child builds an `Engine` from an `EngineSpec` (a checkpoint folder, or random weights of a preset shape),
then serves two pipes: commands (`generate`, a few engine calls) and weight syncs (an `EngineSyncTarget` on
the engine: connect a sender to `EngineProcess.sync_channel`). Between engine steps it reads both, so a sync
can arrive while requests are in flight: they follow the engine's `rollout.update_policy` (finished on the old
weights, or retracted and restarted on the new ones), and every sample carries the `weight_version` it was
generated with.

    engine = EngineProcess(EngineSpec(model_path="ckpt/", dtype="bfloat16")).start()
    sender = make_sender("cuda_ipc", [engine.sync_channel], bucket_mb=512, device="cuda")
    sender.connect()
    sync = TransportWeightSync(policy, sender)
    samples = engine.generate(prompts, SamplingParams(n=8))
    result = sync.sync(version=1)          # the engine now holds the policy's weights, checked bit for bit
    ...
    sync.close(); engine.close()
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from miles.config import RolloutConfig
from miles.rollout import Engine, SamplingParams
from miles.sample import Sample
from miles.weight_sync.channel import Channel
from miles.weight_sync.protocol import ChannelClosed
from miles.weight_sync.target import EngineSyncTarget

log = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """How the child process builds its engine: from `model_path` (a Hugging Face checkpoint folder, with its
    tokenizer if it has one), or, without it, random weights of `preset` (miles/models/presets.py)."""

    model_path: str | None = None
    preset: str | None = None
    arch: str | None = None
    """The tiny preset's architecture (qwen3, qwen3_moe, llama)."""
    vocab_size: int | None = None
    layers: int = 0
    """Keep only the preset's first N layers (0: all): a large shape in a fraction of its memory."""
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    num_threads: int | None = 1
    """torch's intra-op threads in the child (None: torch's default)."""
    reserve_bytes: int = 0
    """GPU memory the engine's KV pool leaves for others (a colocated trainer)."""

    def build(self) -> Engine:
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.model_path is not None and Path(self.model_path).is_dir():
            return Engine.from_path(self.model_path, self.rollout, dtype=self.dtype, device=device)
        if (
            self.model_path is not None
        ):  # builtin:NAME, init:ARCH:PRESET or smollm2:..., as `model.path` reads
            from miles.model_io import load_model

            loaded = load_model(self.model_path, self.dtype, device, seed=self.seed)
            return Engine(loaded.model, loaded.tokenizer, self.rollout, reserve_bytes=self.reserve_bytes)
        if self.preset is None:
            raise ValueError("EngineSpec needs a model_path (checkpoint folder) or a preset (random weights)")
        from miles.models.presets import build_random_model, preset_args

        args = preset_args(self.arch, self.preset, self.vocab_size)
        if self.layers:
            args = replace(args, num_hidden_layers=min(self.layers, args.num_hidden_layers))
        model = build_random_model(args, self.dtype, device, seed=self.seed)
        return Engine(model, None, self.rollout, reserve_bytes=self.reserve_bytes)


# commands (trainer -> engine process) and replies ------------------------------------------------------
@dataclass
class Generate:
    request: int
    prompts: list[Sample] | list[list[int]] | list[str]
    params: SamplingParams
    multiturn: bool = False
    """Through the engine's `rollout.generate_fn` plugin (run here, beside the engine, to the end)."""
    stream: bool = False
    """Send the samples as they finish (`Finished`), then a `Reply` without them."""


@dataclass
class Call:
    request: int
    method: str
    args: tuple = ()


@dataclass
class Stop:
    pass


@dataclass
class Started:
    pid: int
    weight_version: int
    dtype: str
    device: str


@dataclass
class Reply:
    request: int
    value: Any = None
    error: str | None = None


@dataclass
class Finished:
    """A streamed generate call's samples that finished since its last `Finished`, by position in its reply."""

    request: int
    positions: list[int]
    samples: list[Sample]


class EngineProcessError(RuntimeError):
    """The engine process failed a request, died, or stopped answering; the message names it."""


class EngineProcess:
    def __init__(self, spec: EngineSpec, name: str = "engine-0", timeout_s: float = 300.0) -> None:
        """`timeout_s`: how long the trainer side waits for the engine process to start, and its sync
        channel's timeout (how long a sync waits for the engine's next answer)."""
        self.spec, self.name, self.timeout_s = spec, name, float(timeout_s)
        self.process: Any = None
        self.sync_channel: Channel | None = None
        self.info: Started | None = None
        self._commands: Connection | None = None
        self._next_request = 0
        self._replies: dict[int, Reply] = {}
        self._finished: dict[int, list[tuple[int, Sample]]] = {}

    def start(self) -> EngineProcess:
        context = mp.get_context("spawn")
        commands, child_commands = context.Pipe()
        sync, child_sync = context.Pipe()
        self.process = context.Process(
            target=_serve_child,
            args=(self.spec, self.name, child_commands, child_sync, self.timeout_s),
            name=f"miles-{self.name}",
            daemon=True,
        )
        # blocked across the spawn (the child inherits the mask) until the child ignores them
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child_commands.close()
        child_sync.close()
        sync_channel = Channel(sync, f"{self.name} (pid {self.process.pid})", self.timeout_s)
        return self.attach(self.process, commands, sync_channel)

    def attach(
        self, process: Any, commands: Connection, sync_channel: Channel | None = None
    ) -> EngineProcess:
        """Talk to an engine that `serve`s `commands` in `process`, started elsewhere (a Ray actor): anything
        with `is_alive()`, `pid`, `exitcode`, `join(timeout)` and `terminate()`. Its sync channel, if this
        side does not hold it, belongs to whoever sends it weights."""
        self.process, self._commands, self.sync_channel = process, commands, sync_channel
        started = self._receive("starting", self.timeout_s)
        if not isinstance(started, Started):
            raise EngineProcessError(f"{self.name} did not start: {started}")
        self.info = started
        return self

    def __enter__(self) -> EngineProcess:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # requests --------------------------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Sample] | Sequence[list[int]] | Sequence[str],
        params: SamplingParams,
        multiturn: bool = False,
    ) -> int:
        """Queue a generate call; returns its id for `result` (the engine runs it between syncs' messages).
        `multiturn`: through the spec's `rollout.generate_fn`, whose sessions stay on this engine."""
        return self._send(lambda r: Generate(r, list(prompts), params, multiturn))  # type: ignore[arg-type]

    def result(self, request: int, timeout_s: float | None = None) -> Any:
        """The reply to request `request` (a generate call's samples, prompt-major), waiting for it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while request not in self._replies:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise EngineProcessError(
                    f"{self.name} did not answer request {request} within {timeout_s:g} s"
                )
            self._file(self._receive(f"answering request {request}", left))
        reply = self._replies.pop(request)
        if reply.error is not None:
            raise EngineProcessError(f"{self.name}: {reply.error}")
        return reply.value

    def generate(
        self,
        prompts: Sequence[Sample] | Sequence[list[int]] | Sequence[str],
        params: SamplingParams,
        on_finish: Callable[[Sample], None] | None = None,
    ) -> list[Sample]:
        """`Engine.generate` in the engine process: `len(prompts) * params.n` samples, prompt-major. With
        `on_finish`, each sample comes back as it finishes and is handed to it then, as a local engine
        does (rewards start grading while the rest still generate)."""
        if on_finish is None:
            return self.result(self.submit(prompts, params))
        request = self._send(lambda r: Generate(r, list(prompts), params, stream=True))  # type: ignore[arg-type]
        done: dict[int, Sample] = {}
        while True:
            for position, sample in self._finished.pop(request, []):
                done[position] = sample
                on_finish(sample)
            if request in self._replies:
                break
            self._file(self._receive(f"answering request {request}", None))
        self.result(request)  # raises the engine's error, if any
        return [done[position] for position in range(len(done))]

    def call(self, method: str, *args: Any) -> Any:
        """One of `HOST_CALLS` in the engine process, waiting for its value."""
        return self.result(self._send(lambda r: Call(r, method, args)))

    @property
    def weight_version(self) -> int:
        return int(self.call("weight_version"))

    def metrics(self, reset: bool = True) -> dict[str, float]:
        return self.call("metrics", reset)

    def export_weights(self, path: str | Path) -> None:
        """Write the engine's parameters (its own names) to a safetensors file (tests, debugging)."""
        self.call("export_weights", str(path))

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process (its sync transport should be closed first: `sender.close()`)."""
        if self.process is None:
            return
        try:
            if self._commands is not None and self.process.is_alive():
                self._commands.send(Stop())
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("%s did not stop within %g s; terminating it", self.name, timeout_s)
            self.process.terminate()
            self.process.join(5)
        for conn in (self._commands, self.sync_channel.conn if self.sync_channel is not None else None):
            if conn is not None:
                conn.close()
        self.process = None

    # internals -------------------------------------------------------------------------------------
    def _send(self, make: Any) -> int:
        if self._commands is None or not self.alive:
            raise EngineProcessError(f"{self.name} is not running; start() it (or check why it ended)")
        request = self._next_request
        self._next_request += 1
        self._commands.send(make(request))
        return request

    def _file(self, message: object) -> None:
        if isinstance(message, Reply):
            self._replies[message.request] = message
        elif isinstance(message, Finished):
            self._finished.setdefault(message.request, []).extend(zip(message.positions, message.samples))

    def _receive(self, waiting_for: str, timeout_s: float | None) -> object:
        """The next message on the command pipe, checking every second that the process is alive."""
        assert self._commands is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                raise EngineProcessError(
                    f"{self.name} did not answer within {timeout_s:g} s while {waiting_for}"
                )
            try:
                if self._commands.poll(left):
                    return self._commands.recv()
            except (EOFError, OSError):
                pass  # ended: reported below (a socket to a killed actor resets)
            if not self.process.is_alive():
                raise EngineProcessError(
                    f"{self.name} (pid {self.process.pid}) ended with exit code {self.process.exitcode} while "
                    f"{waiting_for}; its error is in its log above"
                )


# the engine process ---------------------------------------------------------------------------------------
@dataclass
class Heartbeat:
    """The serve loop's pulse, for a health check in the same process (a Ray actor's): when it last came
    round, and whether requests were waiting then (an idle engine blocks on its pipes, and is not hung)."""

    last: float = field(default_factory=time.monotonic)
    busy: bool = False

    def beat(self, busy: bool) -> None:
        self.last, self.busy = time.monotonic(), busy

    def stalled_for(self) -> float:
        """Seconds the loop has been stuck with requests waiting (0 when idle or moving)."""
        return time.monotonic() - self.last if self.busy else 0.0


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _serve_child(*args: Any) -> None:
    """`serve` in a process spawned by `EngineProcess`. Ctrl-C and a scheduler's SIGTERM reach the whole
    process group; the trainer side stops after its step and then stops the engine, so the engine ignores
    them (closed pipes still end it if the trainer dies)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    serve(*args)


def serve(
    spec: EngineSpec,
    name: str,
    commands: Connection,
    sync: Connection,
    timeout_s: float,
    heartbeat: Heartbeat | None = None,
    next_sync: Callable[[], Connection | None] | None = None,
) -> None:
    """The engine process's main loop: build the engine, then serve commands and syncs until Stop. When the
    trainer closes the sync channel the loop ends; with `next_sync` (a Ray engine actor's: the trainer rank
    reconnects when it rebuilds its broadcast group) it serves commands on and takes the next channel that
    `next_sync()` returns (None: none yet)."""
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    engine = spec.build()
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)  # the sync's copies and events use the current device's stream
    channel: Connection | None = sync
    target = EngineSyncTarget(engine, Channel(sync, "the trainer", timeout_s), name)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    commands.send(Started(os.getpid(), engine.weight_version, dtype, str(engine.device)))
    host = _Host(engine, commands, _multiturn(engine, spec.rollout, heartbeat))
    while True:
        if channel is None and next_sync is not None and (channel := next_sync()) is not None:
            target = EngineSyncTarget(engine, Channel(channel, "the trainer", timeout_s), name)
        busy = engine.has_unfinished and not host.stalled
        if heartbeat is not None:
            heartbeat.beat(busy)
        idle_wait = None if channel is not None else 0.05  # (a new sync channel wakes no wait)
        ready = wait(
            [commands] + ([channel] if channel is not None else []), timeout=0 if busy else idle_wait
        )
        if channel is not None and channel in ready:
            host.stalled = False
            try:
                target.serve_pending()
            except (EOFError, ChannelClosed):
                if next_sync is None:
                    return  # the trainer is gone
                target.close()
                channel = None
            except Exception as err:  # reported to the trainer already; the engine keeps serving
                log.error("weight sync failed: %s", err)
        if commands in ready:
            host.stalled = False
            try:
                message = commands.recv()
            except EOFError:
                return
            if isinstance(message, Stop):
                return
            host.handle(message)
        if engine.has_unfinished and not host.stalled:
            host.step()
        host.reply_finished()


HOST_CALLS = (
    "weight_version",
    "metrics",
    "export_weights",
    "flush_cache",
    "state_dict",
    "load_state_dict",
    "release_memory",
    "resume_memory",
)


class _Host:
    """The command side of the engine process: requests in flight and their replies."""

    def __init__(self, engine: Engine, commands: Connection, multiturn: Any = None) -> None:
        self.engine, self.commands, self.multiturn = engine, commands, multiturn
        self.pending: dict[int, list[int]] = {}
        """Generate call -> its engine request ids, prompt-major."""
        self.done: dict[int, dict[int, Sample]] = {}
        self.streamed: set[int] = set()
        """Generate calls whose samples go back as they finish."""
        self.stalled = False
        """The engine cannot step (a failed sync left its weights half-updated) until the next message."""

    def handle(self, message: object) -> None:
        if isinstance(message, Generate) and message.multiturn:
            self._generate_multiturn(message)
        elif isinstance(message, Generate):
            try:
                self.pending[message.request] = self._enqueue(message.prompts, message.params)
                self.done[message.request] = {}
                if message.stream:
                    self.streamed.add(message.request)
            except Exception as err:
                self.commands.send(Reply(message.request, error=f"{type(err).__name__}: {err}"))
        elif isinstance(message, Call):
            try:
                self.commands.send(Reply(message.request, self._call(message.method, message.args)))
            except Exception as err:
                self.commands.send(Reply(message.request, error=f"{type(err).__name__}: {err}"))
        else:
            log.warning("ignored an unknown command %s", type(message).__name__)

    def _enqueue(self, prompts: list, params: SamplingParams) -> list[int]:
        """Each prompt's `params.n` requests, as `Engine.generate` queues them (a Sample keeps its group)."""
        rids = []
        for position, prompt in enumerate(prompts):
            source = prompt if isinstance(prompt, Sample) else None
            ids = prompt_ids(self.engine, prompt)
            group = source.group_id if source is not None else position
            text = prompt if isinstance(prompt, str) else None
            for index in range(params.n):
                rids.append(
                    self.engine.add_request(
                        ids, params, group_id=group, index=index, source=source, prompt_text=text
                    )
                )
        return rids

    def _generate_multiturn(self, message: Generate) -> None:
        """The whole call at once: the plugin's sessions step the engine themselves (a sync waits for it)."""
        try:
            if self.multiturn is None:
                raise ValueError("this engine has no rollout.generate_fn to run multi-turn calls with")
            samples = self.multiturn.generate(list(message.prompts), message.params)
        except Exception as err:
            self.commands.send(Reply(message.request, error=f"{type(err).__name__}: {err}"))
            return
        self.commands.send(Reply(message.request, samples))

    def _call(self, method: str, args: tuple) -> Any:
        if method not in HOST_CALLS:
            raise ValueError(f"unknown engine call {method!r}; one of {', '.join(HOST_CALLS)}")
        if method == "metrics" and self.multiturn is not None:
            return {**self.engine.metrics(*args), **self.multiturn.metrics()}
        if method == "weight_version":
            return self.engine.weight_version
        if method == "export_weights":
            from safetensors.torch import save_file

            named = {n: p.detach().cpu().contiguous() for n, p in self.engine.model.named_parameters()}
            save_file(named, args[0])
            return None
        return getattr(self.engine, method)(*args)

    def step(self) -> None:
        try:
            self.engine.step()
        except Exception as err:  # e.g. the weights are half-updated after a failed sync
            what = f"{type(err).__name__}: {err}"
            log.error("engine step failed: %s", what)
            for request in list(self.pending):
                self.commands.send(Reply(request, error=f"the engine failed: {what}"))
                for rid in self.pending.pop(request):
                    self.engine.abort(rid)
                self.done.pop(request, None)
                self.streamed.discard(request)
            self.stalled = True

    def reply_finished(self) -> None:
        for request, rids in list(self.pending.items()):
            done, fresh = self.done[request], []
            for position, rid in enumerate(rids):
                if rid not in done:
                    sample = self.engine.take_result(rid)
                    if sample is not None:
                        done[rid] = sample
                        fresh.append(position)
            streamed = request in self.streamed
            if streamed and fresh:
                self.commands.send(Finished(request, fresh, [done[rids[p]] for p in fresh]))
            if len(done) == len(rids):
                self.commands.send(Reply(request, None if streamed else [done[rid] for rid in rids]))
                del self.pending[request], self.done[request]
                self.streamed.discard(request)


def _multiturn(engine: Engine, rollout: RolloutConfig, heartbeat: Heartbeat | None) -> Any:
    """The engine's `rollout.generate_fn` plugin driver, if it has one (it steps the engine itself, so it
    beats the serve loop's heartbeat)."""
    if not rollout.generate_fn:
        return None
    from miles import plugins
    from miles.rollout import MultiTurnRollout

    fn = plugins.load(plugins.normalize(rollout.generate_fn, "rollout.generate_fn"), "rollout.generate_fn")
    multiturn = MultiTurnRollout(engine, fn, rollout.generate_timeout_s)
    if heartbeat is not None:
        multiturn.on_step = lambda: heartbeat.beat(True)
    return multiturn


def prompt_ids(engine: Engine, prompt: Sample | list[int] | str) -> list[int]:
    """A prompt's token ids as `Engine.generate` reads them: a Sample's `prompt_ids`, else its text or chat
    messages through the engine's tokenizer."""
    if isinstance(prompt, Sample):
        if prompt.prompt_ids:
            return [int(t) for t in prompt.prompt_ids]
        prompt = prompt.prompt  # type: ignore[assignment]
        if isinstance(prompt, list):
            if engine.tokenizer is None:
                raise ValueError("chat-message prompts need a tokenizer (or fill Sample.prompt_ids)")
            ids = engine.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding here, 4.x a list
                ids = ids["input_ids"]
            return [int(t) for t in ids]
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids or a checkpoint with a tokenizer")
        return [int(t) for t in engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    return [int(t) for t in prompt]
