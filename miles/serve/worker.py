"""The thread that owns the engine in `miles serve`: HTTP handler threads queue jobs (a request's prompts)
and tasks (tokenizing: the tokenizer is the engine's); this thread admits them, steps the engine while any
request is in flight, and hands each job its samples, or its streamed text as tokens come. Concurrent
requests share engine steps (continuous batching) and the radix cache."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import torch

from miles.rollout import SamplingParams
from miles.sample import Sample, SampleStatus
from miles.serve.schemas import FINISH, RequestError
from miles.serve.tokens import Detokenizer

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's prompts and what comes back for them, handed between its handler thread and the
    engine's."""

    prompts: list[list[int]]
    params: SamplingParams
    results: dict[tuple[int, int], Sample] = field(default_factory=dict)
    """(prompt position, sample index) -> its sample."""
    error: RequestError | None = None
    cancelled: bool = False
    """Its client stopped waiting: what it still runs is aborted."""
    done: threading.Event = field(default_factory=threading.Event)
    events: queue.Queue[tuple[int, int, str, str | None] | None] | None = None
    """Streaming: (prompt position, sample index, new text, finish reason or None) as tokens come, then None
    once every sample finished (or the job failed: `error`)."""
    decoders: dict[tuple[int, int], Detokenizer] = field(default_factory=dict)
    """Streaming: each sample's incremental detokenizer (the engine thread's)."""

    def usage(self) -> dict[str, int]:
        """OpenAI's token counts of the finished job."""
        completion = sum(len(s.response_ids) for s in self.results.values())
        prompt_tokens = sum(len(p) for p in self.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }


@dataclass
class Task:
    """Work for the engine's thread other than generation (tokenizing: the tokenizer is the engine's)."""

    fn: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def wait_s(deadline: float | None, slice_s: float) -> float:
    """How long to wait before looking again: `slice_s`, or less where the deadline comes first."""
    return slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic()))


class EngineWorker:
    """Owns `engine` on a thread of its own (`start`); every other thread reaches it through `submit`,
    `cancel` and `on_engine`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._jobs: queue.Queue[Job | Task] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def cancel(self, job: Job) -> None:
        job.cancelled = True  # the engine thread aborts what is left of it
        self._jobs.put(job)

    def on_engine(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the engine's thread (between steps) and return what it returns."""
        task = Task(fn)
        self._jobs.put(task)
        if not task.done.wait(timeout_s):
            raise RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE, "the engine thread is not answering", "server_error"
            )
        if task.error is not None:
            raise task.error
        return task.result

    def _loop(self) -> None:
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":  # a new thread's current device is cuda:0
            torch.cuda.set_device(device)
        pending: dict[int, tuple[Job, int, int]] = {}  # rid -> (job, prompt position, sample index)
        waiting: dict[int, int] = {}  # id(job) -> samples still to come
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.05) if not pending else self._jobs.get_nowait()
            except queue.Empty:
                job = None
            while job is not None:
                if isinstance(job, Task):
                    try:
                        job.result = job.fn()
                    except BaseException as err:  # handed back to the handler thread
                        job.error = err
                    job.done.set()
                elif job.cancelled:
                    for rid, (owner, _, _) in pending.items():
                        if owner is job:
                            self.engine.abort(rid)
                else:
                    self._admit(job, pending, waiting)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = None
            if not pending:
                continue
            try:
                self.engine.step()
            except Exception as err:  # the requests in flight fail; the server keeps serving
                log.exception("engine step failed")
                for failed, _, _ in pending.values():
                    failed.error = RequestError(
                        HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"engine error: {type(err).__name__}: {err}",
                        "server_error",
                    )
                    failed.done.set()
                    if failed.events is not None:
                        failed.events.put(None)
                self._drain_engine(list(pending))
                pending.clear()
                waiting.clear()
                continue
            for rid in list(pending):
                sample = self.engine.take_result(rid)
                job, position, index = pending[rid]
                if sample is None:
                    if job.events is not None:
                        self._stream_partial(job, position, index, self.engine.partial_output(rid))
                    continue
                del pending[rid]
                job.results[position, index] = sample
                if job.events is not None:
                    self._stream_final(job, position, index, sample)
                waiting[id(job)] -= 1
                if waiting[id(job)] == 0:
                    del waiting[id(job)]
                    job.done.set()
                    if job.events is not None:
                        job.events.put(None)

    def _stream_partial(self, job: Job, position: int, index: int, ids: list[int] | None) -> None:
        """New text of a running sample, less the characters a stop string may still take back (its length
        less one)."""
        if not ids:
            return
        decoder = job.decoders.setdefault((position, index), Detokenizer())
        decoder.update(self.engine.tokenizer, ids)
        hold = max((len(stop) for stop in job.params.stop), default=1) - 1
        safe = decoder.text[: max(0, len(decoder.text) - hold)]
        if len(safe) > len(decoder.sent):
            job.events.put((position, index, safe[len(decoder.sent) :], None))  # type: ignore[union-attr]
            decoder.sent = safe

    def _stream_final(self, job: Job, position: int, index: int, sample: Sample) -> None:
        if sample.status == SampleStatus.ABORTED and sample.metadata.get("error"):
            job.error = RequestError(HTTPStatus.BAD_REQUEST, sample.metadata["error"])
            return
        decoder = job.decoders.setdefault((position, index), Detokenizer())
        # The non-streamed reply's text: a stop string is matched with special tokens' text too (outputs.py),
        # which the streamed text (special tokens left out) cannot show, so it is not searched here. What was
        # sent is a prefix of it: `_stream_partial` holds back len(stop) - 1 characters, and a stop string's
        # characters in the text without special tokens are at most its own.
        text = sample.response_text
        if not text.startswith(decoder.sent):
            # The pieces decoded so far join differently from the whole (a tokenizer's clean-up rules): finish
            # the streamed text its own way, cut at the first stop string it shows.
            decoder.update(self.engine.tokenizer, sample.response_ids, final=True)
            text = decoder.text
            cuts = [i for i in (text.find(stop) for stop in job.params.stop) if i >= 0]
            if cuts and sample.status == SampleStatus.COMPLETED:
                text = text[: min(cuts)]
        tail = text[len(decoder.sent) :] if text.startswith(decoder.sent) else ""
        job.events.put((position, index, tail, FINISH.get(sample.status, "abort")))  # type: ignore[union-attr]

    def _admit(self, job: Job, pending: dict[int, tuple[Job, int, int]], waiting: dict[int, int]) -> None:
        one = job.params.with_(n=1)
        rids: list[tuple[int, int, int]] = []
        try:
            for position, ids in enumerate(job.prompts):
                for index in range(job.params.n):
                    rid = self.engine.add_request(ids, one, group_id=position, index=index)
                    rids.append((rid, position, index))
        except Exception as err:  # a ValueError is the request's (stop strings without a tokenizer, ...)
            if isinstance(err, ValueError):
                job.error = RequestError(HTTPStatus.BAD_REQUEST, str(err))
            else:
                log.exception("admitting a request failed")
                job.error = RequestError(
                    HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(err).__name__}: {err}", "server_error"
                )
            job.done.set()
            if job.events is not None:
                job.events.put(None)
            self._drain_engine([rid for rid, _, _ in rids])
            return
        for rid, position, index in rids:
            pending[rid] = (job, position, index)
        waiting[id(job)] = len(rids)

    def _drain_engine(self, rids: list[int]) -> None:
        """Abort `rids` and step them out of the engine, so none of their results stays behind."""
        for rid in rids:
            self.engine.abort(rid)
        left = set(rids)
        for _ in range(100):
            left = {rid for rid in left if self.engine.take_result(rid) is None}
            if not left or not self.engine.has_unfinished:
                break
            try:
                self.engine.step()
            except Exception:  # still failing: give up on these results rather than loop
                log.exception("engine step failed while dropping failed requests")
                break
