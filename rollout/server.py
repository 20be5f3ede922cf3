"""An OpenAI-compatible HTTP server over the embedded engine: `miles serve`.

`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (and `/v1/models/{id}`), `GET /health`;
a query string (`?api-version=...`, as Azure-style clients send) is ignored. One thread owns the engine and
steps it while any request is in flight; HTTP handler threads hand it their prompts and wait, so concurrent
requests share engine steps (continuous batching) and the radix cache. Binds 127.0.0.1 unless told otherwise
(an IPv6 host such as `::1` binds an IPv6 socket); with an API key set, every request needs
`Authorization: Bearer <key>`. Request bodies and keys are never logged.

Beyond OpenAI's fields, a request may set `top_k`, `min_p`, `ignore_eos`, `stop_token_ids` and
`return_token_ids` (the prompt's and each choice's token ids, for token-in/token-out clients). `logprobs`
returns the sampled tokens' logprobs, under the distribution they were sampled from (temperature, top-p...:
the engine's convention, docs/rollout.md), with up to 20 alternatives per token under the same distribution
(completions: `logprobs: N`, 0 for the sampled tokens' only; chat: `logprobs: true, top_logprobs: N`). A
token's text and `bytes` are its own bytes (a byte-level token holding part of a character shows the bytes
it lacks a character for as `\\xNN`); a logprob of -inf (an alternative top-p or top-k dropped) is sent as
-9999.0, as vLLM does, so the JSON stays strict. A `temperature` below 1e-5 is greedy (temperature 0): so
small a divisor overflows the logits to NaN. `stream: true` sends server-sent events (OpenAI's chunks, then
`data: [DONE]`; `stream_options.include_usage` adds the usage), holding back the last characters while a
stop string could still take them back, and a `: keep-alive` comment while nothing can be sent (a tool call
being generated, a long prefill). A client that hangs up stops its generation, streamed (a write fails) or
not (its socket is watched while it waits). Chat completions take `tools` (with `tool_choice` "auto",
"none", "required" or a named function, which start the reply with a call's opening, and
`parallel_tool_calls`), `tool_calls` in assistant messages and `tool` messages, and return the
model's calls as `tool_calls`, streamed or not, where the model's chat template renders tools in Qwen's
`<tool_call>` format (tool_calls.py); with a reasoning parser, a thinking model's `<think>` block comes back
as `reasoning_content` (reasoning.py). Not supported, and refused with a 400 rather than ignored: `echo`, a
non-empty `suffix`, `best_of` > 1, logprobs or token ids with streaming, non-zero `frequency_penalty` /
`presence_penalty`, `logit_bias`, the
legacy `functions` / `function_call`, and a `response_format` other than `{"type": "text"}`. Chat content
may be a string or text parts; a chat template that refuses the conversation (`raise_exception`) is a 400.
Tokenizing runs on the engine's thread (the tokenizer is the engine's); a request waiting past
`request_timeout_s` (inf: no limit) gets a 504 and what it still runs is aborted.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import math
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from miles.rollout.chat_reply import ReplyFormat, ReplyStream, reply_message
from miles.rollout.params import SamplingParams
from miles.rollout.reasoning import prompt_opens_thinking
from miles.rollout.sampling import MAX_TOP_LOGPROBS
from miles.rollout.tool_calls import (
    ToolChoice,
    ToolError,
    check_tool_choice,
    check_tools,
    template_messages,
    template_renders_tools,
)
from miles.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""Both write their thinking between `<think>` and `</think>` (reasoning.py)."""
_FINISH = {SampleStatus.COMPLETED: "stop", SampleStatus.TRUNCATED: "length"}
GREEDY_BELOW = 1e-5
"""A temperature under this samples greedily: logits divided by a smaller one overflow float32 (NaN)."""
NO_LOGPROB = -9999.0
"""Sent for a logprob that is not finite (-inf: an alternative top-p / top-k dropped), as vLLM does: JSON has
no infinity, and a bare `-Infinity` breaks strict parsers."""
KEEPALIVE_S = 0.5
"""A stream with nothing to send for this long sends an SSE comment: writing is how a hang-up is noticed."""
CLIENT_POLL_S = 0.25
"""How often a non-streamed request looks whether its client hung up while it waits."""
CLIENT_IO_TIMEOUT_S = 60.0
"""A connection's socket reads and writes give up after this long: a client that sends a request slowly or
only in part (a Content-Length longer than its body), or stops reading a stream, would otherwise hold a server
thread (and a stream's generation) for ever. Idle keep-alive connections close after it too."""
MAX_SAMPLES_PER_REQUEST = 1024
"""Default cap on a request's samples (its prompts × `n`; `miles serve --max-samples-per-request`): one
request may otherwise queue more generation than the server runs in hours, ahead of everyone else's."""
MAX_CONNECTIONS = 256
"""Default cap on open connections (`miles serve --max-connections`), each holding a thread; past it a new
connection gets a 503 at once and is closed."""
_NO_OPS: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "'echo' is not supported"),
    "suffix": (("",), "'suffix' is not supported (no insertion; send it empty or not at all)"),
    "logit_bias": (({},), "'logit_bias' is not supported"),
    "functions": (([],), "'functions' is not supported (send 'tools' instead)"),
    "function_call": (("none",), "'function_call' is not supported (send 'tools' instead)"),
    "response_format": (
        ({"type": "text"},),
        '\'response_format\' is not supported (no JSON mode; only {"type": "text"})',
    ),
}
"""OpenAI fields the server does not implement: (the values that ask for nothing, besides null; the 400's
message for any other)."""


class RequestError(Exception):
    """A request the server refuses: its status and an OpenAI-style error body."""

    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def payload(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.kind, "code": int(self.status)}}


class ClientGone(Exception):
    """The client of a request hung up while it waited: its generation was aborted, no response is sent."""


@dataclass
class _Job:
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
    decoders: dict[tuple[int, int], _Detokenizer] = field(default_factory=dict)
    """Streaming: each sample's incremental detokenizer (the engine thread's)."""


@dataclass
class _Detokenizer:
    """A streamed sample's text, decoded a few tokens at a time (as vLLM does): each step decodes the tokens
    since `prefix`, so the cost per step stays small however long the output, and a character split over
    tokens waits until it is whole. `sent` is what went to the client."""

    prefix: int = 0
    read: int = 0
    text: str = ""
    sent: str = ""

    def update(self, tokenizer: Any, ids: list[int], final: bool = False) -> None:
        """Decode the tokens since `read`; `final`: take what they decode to even if a character is cut."""
        if len(ids) <= self.read:
            return
        before = tokenizer.decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.prefix :], skip_special_tokens=True)
        whole = len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before)
        if whole or final:
            self.text += after[len(os.path.commonprefix([before, after])) :]
            self.prefix, self.read = self.read, len(ids)


@dataclass
class _Task:
    """Work for the engine's thread other than generation (tokenizing: the tokenizer is the engine's)."""

    fn: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class EngineServer:
    """Serves `engine` over HTTP; `start()` runs it in background threads, `serve_forever()` in this one."""

    def __init__(
        self,
        engine: Any,
        formatter: Any,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        request_timeout_s: float | None = 3600.0,
        reasoning_parser: str | None = None,
        max_samples_per_request: int = MAX_SAMPLES_PER_REQUEST,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """`reasoning_parser`: "qwen3" (or "deepseek_r1", the same `<think>` tags) splits chat replies'
        thinking off as `reasoning_content` (reasoning.py); None leaves it in the content.
        `request_timeout_s`: > 0 seconds; inf or None: no limit. `max_samples_per_request`: a request whose
        prompts × `n` is larger gets a 400; `max_connections`: connections open at once (a 503 past it)."""
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; use one of {REASONING_PARSERS}")
        for name, value in (
            ("max_samples_per_request", max_samples_per_request),
            ("max_connections", max_connections),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_samples_per_request = max_samples_per_request
        self.request_timeout_s = request_timeout(request_timeout_s)  # checked before the socket is bound
        self.reasoning = reasoning_parser is not None
        self.engine, self.formatter, self.model_name = engine, formatter, model_name
        self.api_key = api_key or None
        self.keepalive_s = KEEPALIVE_S
        self.client_poll_s = CLIENT_POLL_S
        self.client_io_timeout_s = CLIENT_IO_TIMEOUT_S
        self._jobs: queue.Queue[_Job | _Task] = queue.Queue()
        self._stop = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="miles-engine", daemon=True)
        self._http_thread: threading.Thread | None = None
        self._renders_tools: bool | None = None
        """Whether the formatter's chat template renders tools in the `<tool_call>` format (probed once)."""
        self._token_bytes: TokenBytes | None = None
        """Each token's bytes, for logprobs (built once, on the engine's thread)."""
        server_class = _HTTPServer6 if ":" in host else _HTTPServer  # an IPv6 address (::1, ::)
        self.httpd = server_class((host, port), _handler_for(self), max_connections)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._engine_thread.start()
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="miles-http", daemon=True)
        self._http_thread.start()

    def serve_forever(self) -> None:
        self._engine_thread.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self._stop.set()
        if self._http_thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        if self._engine_thread.is_alive():
            self._engine_thread.join(timeout=10)

    # the engine's thread ----------------------------------------------------------------------------
    @property
    def engine_alive(self) -> bool:
        return self._engine_thread.is_alive()

    def run(
        self, prompts: list[list[int]], params: SamplingParams, client_gone: Callable[[], bool] | None = None
    ) -> _Job:
        """Called from a handler thread: queue the prompts and wait for their samples. `client_gone` is
        asked every `client_poll_s` while it waits: a client that hung up (an SDK's timeout, which then
        retries) would otherwise have its generation run to the end for nobody."""
        job = _Job(prompts, params)
        timeout_s = self.request_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._jobs.put(job)
        while not job.done.wait(self._wait_s(deadline, self.client_poll_s)):
            if client_gone is not None and client_gone():
                self._cancel(job)
                raise ClientGone()
            if deadline is not None and time.monotonic() >= deadline:
                self._cancel(job)
                raise RequestError(
                    HTTPStatus.GATEWAY_TIMEOUT, f"generation took longer than {timeout_s:g} s", "timeout"
                )
        return job

    @staticmethod
    def _wait_s(deadline: float | None, slice_s: float) -> float:
        """How long to wait before looking again: `slice_s`, or less where the deadline comes first."""
        return slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic()))

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True  # the engine thread aborts what is left of it
        self._jobs.put(job)

    def on_engine(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the engine's thread (between steps) and return what it returns."""
        task = _Task(fn)
        self._jobs.put(task)
        if not task.done.wait(timeout_s):
            raise RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE, "the engine thread is not answering", "server_error"
            )
        if task.error is not None:
            raise task.error
        return task.result

    def _engine_loop(self) -> None:
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":  # a new thread's current device is cuda:0
            torch.cuda.set_device(device)
        pending: dict[int, tuple[_Job, int, int]] = {}  # rid -> (job, prompt position, sample index)
        waiting: dict[int, int] = {}  # id(job) -> samples still to come
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.05) if not pending else self._jobs.get_nowait()
            except queue.Empty:
                job = None
            while job is not None:
                if isinstance(job, _Task):
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

    def _stream_partial(self, job: _Job, position: int, index: int, ids: list[int] | None) -> None:
        """New text of a running sample, less the characters a stop string may still take back (its length
        less one)."""
        if not ids:
            return
        decoder = job.decoders.setdefault((position, index), _Detokenizer())
        decoder.update(self.engine.tokenizer, ids)
        hold = max((len(stop) for stop in job.params.stop), default=1) - 1
        safe = decoder.text[: max(0, len(decoder.text) - hold)]
        if len(safe) > len(decoder.sent):
            job.events.put((position, index, safe[len(decoder.sent) :], None))  # type: ignore[union-attr]
            decoder.sent = safe

    def _stream_final(self, job: _Job, position: int, index: int, sample: Sample) -> None:
        if sample.status == SampleStatus.ABORTED and sample.metadata.get("error"):
            job.error = RequestError(HTTPStatus.BAD_REQUEST, sample.metadata["error"])
            return
        decoder = job.decoders.setdefault((position, index), _Detokenizer())
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
        job.events.put((position, index, tail, _FINISH.get(sample.status, "abort")))  # type: ignore[union-attr]

    def _admit(self, job: _Job, pending: dict[int, tuple[_Job, int, int]], waiting: dict[int, int]) -> None:
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

    # requests --------------------------------------------------------------------------------------
    def completions(
        self, body: dict[str, Any], client_gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any] | None]:
        self._check_model(body)
        if body.get("tools") not in (None, []):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'tools' are for /v1/chat/completions")
        prompt = body.get("prompt")
        self._check_sample_count(body, len(prompt) if _many_prompts(prompt) else 1)  # before tokenizing
        prompts = self.on_engine(lambda: self._prompt_ids(prompt))
        if body.get("stream"):
            return self._stream(prompts, body, 16, "text_completion", "cmpl")
        job = self._generate(prompts, body, 16, client_gone)
        choices = []
        for position in range(len(prompts)):
            for index in range(job.params.n):
                sample = job.results[position, index]
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": sample.response_text,
                    "finish_reason": _FINISH[sample.status],
                    "logprobs": None,
                }
                if _logprobs_asked(body, chat=False):
                    choice["logprobs"] = self._completion_logprobs(sample)
                if body.get("return_token_ids"):
                    _add_token_ids(choice, sample)
                choices.append(choice)
        return self._envelope("text_completion", "cmpl", choices, job)

    def chat_completions(
        self, body: dict[str, Any], client_gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any] | None]:
        self._check_model(body)
        messages = [_message(m) for m in _messages(body.get("messages"))]
        if self.engine.tokenizer is None:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, "this model has no tokenizer: use /v1/completions with ids"
            )
        messages, tools, choice = self._tools(body, messages)
        self._check_sample_count(body, 1)
        prompts = [self._chat_prompt(messages, tools)]
        thinking = self.on_engine(lambda: self._opens_thinking(prompts[0]))
        if choice.opening:
            if thinking:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST,
                    "a forced tool call cannot start inside the thinking block this model's template opens; "
                    "send tool_choice 'auto'",
                )
            tokenizer = self.engine.tokenizer
            prompts = [
                prompts[0]
                + self.on_engine(lambda: tokenizer.encode(choice.opening, add_special_tokens=False))
            ]
        fmt = ReplyFormat(
            reasoning=self.reasoning,
            thinking=self.reasoning and thinking,
            tool_calls=choice.parse,
            call_limit=1 if choice.single or body.get("parallel_tool_calls") is False else None,
            opening=choice.opening,
        )
        if body.get("stream"):
            return self._stream(prompts, body, None, "chat.completion.chunk", "chatcmpl", fmt)
        job = self._generate(prompts, body, None, client_gone)
        choices = []
        for index in range(job.params.n):
            sample = job.results[0, index]
            message, finish = reply_message(sample.response_text, _FINISH[sample.status], fmt)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if _logprobs_asked(body, chat=True):
                choice["logprobs"] = self._chat_logprobs(sample)
            if body.get("return_token_ids"):
                _add_token_ids(choice, sample)
            choices.append(choice)
        return self._envelope("chat.completion", "chatcmpl", choices, job)

    def _completion_logprobs(self, sample: Sample) -> dict[str, Any]:
        """Completions' logprobs: each token's text and logprob, and its alternatives as {text: logprob}."""
        tokens, alternatives = self._logprob_tokens(sample)
        return {
            "tokens": [_token_text(t) for t in tokens],
            "token_logprobs": [_logprob(lp) for lp in sample.rollout_logprobs],
            "top_logprobs": [
                {_token_text(a): _logprob(lp) for a, (_, lp) in zip(alts, position)}
                for alts, position in zip(alternatives, sample.top_logprobs)
            ]
            if sample.top_logprobs is not None
            else None,
            "text_offset": None,
        }

    def _chat_logprobs(self, sample: Sample) -> dict[str, Any]:
        """Chat's logprobs: each token's text, logprob and bytes, with its alternatives alike."""
        tokens, alternatives = self._logprob_tokens(sample)
        positions = sample.top_logprobs or [[] for _ in tokens]

        def entry(token: bytes, logprob: float) -> dict[str, Any]:
            return {"token": _token_text(token), "logprob": _logprob(logprob), "bytes": list(token)}

        return {
            "content": [
                {**entry(token, lp), "top_logprobs": [entry(a, alp) for a, (_, alp) in zip(alts, position)]}
                for token, lp, alts, position in zip(tokens, sample.rollout_logprobs, alternatives, positions)
            ]
        }

    def _logprob_tokens(self, sample: Sample) -> tuple[list[bytes], list[list[bytes]]]:
        """The bytes of the sample's tokens and of each position's alternatives (none without
        `top_logprobs`), in one trip to the engine's thread (the tokenizer is the engine's)."""
        positions = sample.top_logprobs or [[] for _ in sample.response_ids]
        flat = [t for position in positions for t, _ in position]
        every = self._token_bytes_of([*sample.response_ids, *flat])
        tokens, rest = every[: len(sample.response_ids)], iter(every[len(sample.response_ids) :])
        return tokens, [[next(rest) for _ in position] for position in positions]

    def _token_bytes_of(self, ids: list[int]) -> list[bytes]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return [str(t).encode() for t in ids]

        def run() -> list[bytes]:
            if self._token_bytes is None:
                self._token_bytes = TokenBytes(tokenizer)
            return self._token_bytes(ids)

        return self.on_engine(run)

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The chat template's prompt ids. A template that refuses the conversation (`raise_exception`, as
        Qwen3's "No user query found in messages." does) answers the client, a 400; a template that does not
        parse is the server's own fault and stays a 500."""
        try:
            return self.on_engine(lambda: self.formatter.ids(messages, tools))
        except Exception as err:
            if not _template_refused(err):
                raise
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"the model's chat template refused these messages: {err}"
            ) from err

    def _tools(
        self, body: dict[str, Any], messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolChoice]:
        """(messages for the chat template, tools for it, what `tool_choice` asks of the reply)."""
        try:
            tools = check_tools(body["tools"]) if body.get("tools") not in (None, []) else None
            choice = check_tool_choice(body.get("tool_choice"), tools)
            history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
            if (tools is not None or history) and not self.on_engine(self._check_renders_tools):
                raise ToolError(
                    "this model's chat template does not render tools in the <tool_call> format (Qwen2.5, "
                    "Qwen3 and Hermes templates do); send the tools in a message's text instead"
                )
            return template_messages(messages), tools if choice.parse else None, choice
        except ToolError as err:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(err)) from None

    def _opens_thinking(self, prompt_ids: list[int]) -> bool:
        return prompt_opens_thinking(self.engine.tokenizer.decode(prompt_ids[-16:]))

    def _check_renders_tools(self) -> bool:
        if self._renders_tools is None:
            f = self.formatter
            self._renders_tools = (
                f.use_chat_template and f.cfg.prompt_template is None and template_renders_tools(f.tokenizer)
            )
        return self._renders_tools

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model()]}

    def model(self, model_id: str | None = None) -> dict[str, Any]:
        """`GET /v1/models/{id}`: the served model's entry; another id is a 404."""
        if model_id is not None and model_id != self.model_name:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"model {model_id!r} is not served here; this server serves {self.model_name!r}",
                "model_not_found",
            )
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles"}

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                "model_not_found",
            )

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        def ids_of(p: Any) -> list[int]:
            if isinstance(p, str):
                if self.engine.tokenizer is None:
                    raise RequestError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer: send token ids")
                return list(self.engine.tokenizer(p)["input_ids"])
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return list(p)
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                "'prompt' must be a string, a list of strings, or token ids (list of ints)",
            )

        if _many_prompts(prompt):
            return [ids_of(p) for p in prompt]
        return [ids_of(prompt)]

    def _check_sample_count(self, body: dict[str, Any], prompts: int) -> None:
        """A 400 for a request asking for more than `max_samples_per_request` samples (prompts × `n`)."""
        n = _given(body, "n", 1)
        if isinstance(n, int) and not isinstance(n, bool) and prompts * n > self.max_samples_per_request:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"{prompts} prompt(s) x n={n} asks for {prompts * n} samples; this server takes at most "
                f"{self.max_samples_per_request} a request (miles serve --max-samples-per-request): "
                "split the request",
            )

    def _generate(
        self,
        prompts: list[list[int]],
        body: dict[str, Any],
        default_max_tokens: int | None,
        client_gone: Callable[[], bool] | None = None,
    ) -> _Job:
        params = _sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
        job = self.run(prompts, params, client_gone)
        if job.error is not None:
            raise job.error
        for sample in job.results.values():
            if sample.status == SampleStatus.ABORTED:  # refused by the engine (too long for the context, ...)
                raise RequestError(HTTPStatus.BAD_REQUEST, sample.metadata.get("error", "request aborted"))
        return job

    def _stream(
        self,
        prompts: list[list[int]],
        body: dict[str, Any],
        default_max_tokens: int | None,
        kind: str,
        prefix: str,
        fmt: ReplyFormat | None = None,
    ) -> Iterator[dict[str, Any] | None]:
        """Server-sent events: the text of each choice as it is generated (OpenAI's chunk objects); a chat
        reply's as `fmt` says (chat_reply.py). Everything that can refuse the request runs before its job
        is queued: a job queued for a refused request would generate for nobody."""
        if self.engine.tokenizer is None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "streaming needs a tokenizer; send stream=false")
        chat = kind == "chat.completion.chunk"
        if _logprobs_asked(body, chat) or body.get("return_token_ids"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "logprobs and return_token_ids need stream=false")
        include_usage = _include_usage(body.get("stream_options"))
        params = _sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
        # Refused before any event, as a non-streamed request would be (the engine's own checks).
        problems = self.on_engine(lambda: [self.engine.validate_prompt(ids) for ids in prompts])
        for problem in problems:
            if problem is not None:
                raise RequestError(HTTPStatus.BAD_REQUEST, problem)
        job = _Job(prompts, params, events=queue.Queue())
        self._jobs.put(job)
        return self._events(job, kind, prefix, include_usage, fmt or ReplyFormat())

    def _events(
        self, job: _Job, kind: str, prefix: str, include_usage: bool, fmt: ReplyFormat
    ) -> Iterator[dict[str, Any] | None]:
        """The stream's chunks; None for a keep-alive comment, sent when nothing else went out for
        `keepalive_s` (a tool call or a partial tag held back, a long prefill): the write is what notices a
        client that hung up, which then stops its generation."""
        ident, created, n = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), job.params.n
        chat = kind == "chat.completion.chunk"
        replies: dict[int, ReplyStream] = {}

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": ident,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }

        finished = False
        try:
            if chat:  # OpenAI opens each choice with the role
                yield chunk(
                    [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for i in range(len(job.prompts) * n)
                    ]
                )
            timeout_s = self.request_timeout_s
            stall_at = None if timeout_s is None else time.monotonic() + timeout_s
            sent_at = time.monotonic()
            while True:
                try:
                    event = job.events.get(timeout=self._wait_s(stall_at, self.keepalive_s))  # type: ignore[union-attr]
                except queue.Empty:
                    if stall_at is not None and time.monotonic() >= stall_at:
                        yield {
                            "error": {
                                "message": "generation stalled past the request timeout",
                                "type": "timeout",
                            }
                        }
                        return
                    sent_at = time.monotonic()
                    yield None
                    continue
                stall_at = None if timeout_s is None else time.monotonic() + timeout_s
                if event is None:
                    break
                position, index, text, finish = event
                if chat:
                    reply = replies.setdefault(position * n + index, ReplyStream(fmt))
                    delta, finish = reply.delta(text, finish)
                    if delta or finish is not None:
                        sent_at = time.monotonic()
                        yield chunk(
                            [{"index": position * n + index, "delta": delta, "finish_reason": finish}]
                        )
                    elif (
                        time.monotonic() - sent_at >= self.keepalive_s
                    ):  # held back (a tool call, a partial tag)
                        sent_at = time.monotonic()
                        yield None
                else:
                    sent_at = time.monotonic()
                    yield chunk(
                        [
                            {
                                "index": position * n + index,
                                "text": text,
                                "finish_reason": finish,
                                "logprobs": None,
                            }
                        ]
                    )
            finished = True
            if job.error is not None:
                yield {"error": {"message": job.error.message, "type": job.error.kind}}
                return
            if include_usage:
                yield {**chunk([]), "usage": _usage(job)}
        finally:
            if not finished:  # the client went away (or the stream stalled): stop generating for it
                self._cancel(job)

    def _token_strings(self, ids: list[int]) -> list[str]:
        """Each token's text, as logprobs show it (`_token_text` of its bytes)."""
        return [_token_text(b) for b in self._token_bytes_of(ids)]

    def _envelope(self, kind: str, prefix: str, choices: list[dict[str, Any]], job: _Job) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(job),
        }


def _usage(job: _Job) -> dict[str, int]:
    completion = sum(len(s.response_ids) for s in job.results.values())
    prompt_tokens = sum(len(p) for p in job.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _add_token_ids(choice: dict[str, Any], sample: Sample) -> None:
    """`return_token_ids`: the prompt's and the choice's token ids (token-in/token-out clients)."""
    choice["prompt_token_ids"] = list(sample.prompt_ids)
    choice["token_ids"] = list(sample.response_ids)


def request_timeout(seconds: float | None) -> float | None:
    """A request's time limit: > 0 seconds, or None for none (inf, a natural "no limit", is None: waiting
    `inf` seconds raises in Python's threading)."""
    if seconds is None or seconds == math.inf:
        return None
    if not 0 < seconds < math.inf:  # NaN fails too
        raise ValueError(f"request_timeout_s must be > 0 seconds (inf: no limit), got {seconds}")
    return float(seconds)


def _template_refused(err: BaseException) -> bool:
    """Whether `err` is a chat template refusing the conversation: jinja2's TemplateError, which the
    templates' `raise_exception` raises, but not a TemplateSyntaxError (a template that does not parse)."""
    jinja2 = sys.modules.get("jinja2")  # loaded by whatever rendered the template; not loaded: none did
    if jinja2 is None:
        return False
    return isinstance(err, jinja2.TemplateError) and not isinstance(err, jinja2.TemplateSyntaxError)


def _logprobs_asked(body: dict[str, Any], chat: bool) -> bool:
    """Whether the request asks for logprobs. Chat's `logprobs` is a boolean; completions' an integer, 0
    included (the sampled tokens' logprobs, no alternatives), so only null or false turn it off there."""
    value = body.get("logprobs")
    return bool(value) if chat else value is not None and value is not False


def _include_usage(options: Any) -> bool:
    """`stream_options.include_usage`; anything but an object (or null) is a 400, checked before the job
    is queued."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, "'stream_options' must be an object, e.g. {\"include_usage\": true}"
        )
    return bool(options.get("include_usage"))


def _logprob(value: float) -> float:
    """A logprob JSON can hold: a non-finite one (-inf: dropped by top-p / top-k) becomes NO_LOGPROB."""
    return value if math.isfinite(value) else NO_LOGPROB


def _token_text(token: bytes) -> str:
    """A token's text for logprobs: its bytes as UTF-8, where a byte that is part of a character the token
    holds only a piece of shows as `\\xNN` (as OpenAI's API does), not U+FFFD: so the pieces of different
    characters stay apart (completions' alternatives are keyed by their text) and none reads as a character."""
    return token.decode("utf-8", errors="backslashreplace")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (the byte each of its characters stands for): printable bytes
    stand for themselves, the others, in order, for the characters from U+0100 (`bytes_to_unicode`)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own bytes, from its vocabulary entry: decoding one token at a time turns a byte-level
    token that holds part of a multi-byte character into U+FFFD, losing the bytes logprobs' `bytes` exist
    to give. Byte-level BPE (GPT-2, Llama 3, Qwen): the entry's characters stand for bytes. SentencePiece:
    `<0xNN>` byte-fallback entries are that byte, `▁` a space. Anything else (added tokens, tokenizers of
    other kinds, entries outside the alphabet): the token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.metaspace = "Metaspace" in kinds or "Replace▁" in kinds
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}

    def __call__(self, ids: list[int]) -> list[bytes]:
        if self.byte_level or self.byte_fallback or self.metaspace:
            pieces = list(self.tokenizer.convert_ids_to_tokens([int(t) for t in ids]))
        else:
            pieces = [None] * len(ids)
        return [self._one(int(t), piece) for t, piece in zip(ids, pieces)]

    def _one(self, token: int, piece: str | None) -> bytes:
        if token in self.added:
            return self.added[token].encode()
        if isinstance(piece, str) and piece:
            if self.byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            if self.byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])
            if self.metaspace and not self.byte_level:
                return piece.replace("\u2581", " ").encode()
        return str(self.tokenizer.decode([token])).encode()


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types in a fast tokenizer's decoder (a Sequence's too), "Replace▁" for a `▁` -> space Replace;
    empty where there is none to read (a slow tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:  # a decoder that does not serialise: no shortcut, each token decoded alone
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        part = stack.pop()
        if not isinstance(part, dict):
            continue
        kinds.add(str(part.get("type")))
        if part.get("type") == "Replace" and part.get("pattern", {}).get("String") == "\u2581":
            kinds.add("Replace▁")
        stack += part.get("decoders") or []
    return kinds


def _sampling_params(
    body: dict[str, Any], default_max_tokens: int | None, max_context: int, prompts: list[list[int]]
) -> SamplingParams:
    for key, (no_ops, message) in _NO_OPS.items():
        if body.get(key) is not None and body[key] not in no_ops:
            raise RequestError(HTTPStatus.BAD_REQUEST, message)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} is not supported (only 0)")
    if body.get("best_of") not in (None, 1):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'best_of' > 1 is not supported")
    alternatives = _alternatives_asked(body)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is None:  # chat: up to the end of the context
        max_tokens = max(1, max_context - max(len(p) for p in prompts))
    stop = body.get("stop") or []
    try:
        temperature = float(_given(body, "temperature", 1.0))
        return SamplingParams(
            n=int(_given(body, "n", 1)),
            temperature=0.0 if 0 < temperature < GREEDY_BELOW else temperature,
            top_p=float(_given(body, "top_p", 1.0)),
            top_k=int(_given(body, "top_k", -1)),
            min_p=float(_given(body, "min_p", 0.0)),
            max_new_tokens=int(max_tokens),
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=[int(t) for t in body.get("stop_token_ids") or []],
            seed=None if body.get("seed") is None else int(body["seed"]),
            ignore_eos=bool(_given(body, "ignore_eos", False)),
            top_logprobs=alternatives,
        )
    except (TypeError, ValueError, OverflowError) as err:  # OverflowError: int() of Infinity or 1e999
        raise RequestError(HTTPStatus.BAD_REQUEST, f"bad sampling parameter: {err}") from err


def _alternatives_asked(body: dict[str, Any]) -> int:
    """Alternatives per token: chat's `top_logprobs` (with `logprobs: true`), or completions' `logprobs: N`."""
    top, logprobs = body.get("top_logprobs"), body.get("logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]"
            )
        if top and not logprobs:
            raise RequestError(HTTPStatus.BAD_REQUEST, "'top_logprobs' needs 'logprobs': true")
        return top
    if logprobs is None or isinstance(logprobs, bool):
        return 0
    if not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"'logprobs' must be a boolean or an integer in [0, {MAX_TOP_LOGPROBS}]"
        )
    return logprobs


def _many_prompts(prompt: Any) -> bool:
    """Whether a completions `prompt` is a list of prompts (strings or id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    """`body[key]`, or `default` where it is absent or null (OpenAI's fields are nullable)."""
    value = body.get(key)
    return default if value is None else value


def _messages(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list of {role, content}")
    return messages


def _message(m: Any) -> dict[str, Any]:
    """A chat message as {role, content}: text content parts are joined; an assistant's null content is ''.
    An assistant's `tool_calls` and a tool message's `tool_call_id` / `name` come along (checked where the
    tools are, `EngineServer._tools`)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(HTTPStatus.BAD_REQUEST, "each message needs a string 'role' and a 'content'")
    content = m.get("content")
    if content is None and m["role"] == "assistant":
        content = ""
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise RequestError(HTTPStatus.BAD_REQUEST, "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(HTTPStatus.BAD_REQUEST, "a message's 'content' must be a string or text parts")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    if m["role"] == "tool":
        out.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
    return out


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: past it a connection gets a 503 and is
    closed at once (without the cap every connection, idle ones too, holds a thread until its timeout)."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse_busy(sock: socket.socket, limit: int) -> None:
    """A 503 on a connection past the cap, sent from the accepting thread (a few hundred bytes into a new
    socket's empty buffer: it does not block, and a client that never reads cannot hold the accept loop)."""
    busy = RequestError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"server busy: {limit} connections open (miles serve --max-connections); retry later",
        "server_busy",
    )
    data = _json(busy.payload())
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    )
    try:
        sock.settimeout(1.0)
        sock.sendall(head.encode() + data)
    except OSError:
        pass  # it left already


class _HTTPServer6(_HTTPServer):
    """The HTTP server on an IPv6 socket (`--host ::1`): socketserver's default family is IPv4 only."""

    address_family = socket.AF_INET6


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client at the other end of `sock` hung up: the socket reads as closed (EOF) or broken.
    Bytes waiting there (a pipelined request) are left unread and are no hang-up; nothing waits."""
    try:
        if hasattr(select, "poll"):  # poll has no FD_SETSIZE limit, which select's 1024 is
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            readable = bool(poller.poll(0))
        else:
            readable = bool(select.select([sock], [], [], 0)[0])
        return readable and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset by the peer, or already closed here
        return True


def _handler_for(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    routes = {
        ("POST", "/v1/completions"): server.completions,
        ("POST", "/v1/chat/completions"): server.chat_completions,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _body_consumed = False
        """This request's body was read or discarded (reading it twice would block on the next request)."""

        @property
        def timeout(self) -> float:  # type: ignore[override]  # read by StreamRequestHandler.setup
            return server.client_io_timeout_s

        @property
        def route_path(self) -> str:
            """The path without its query string (`?api-version=...`), which no route reads."""
            return urllib.parse.urlsplit(self.path).path

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._body_consumed = False
            if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
                self._discard_body()  # else a body would be read as the next request on this connection
            path = self.route_path
            if path == "/health":
                if server.engine_alive:
                    self._send(HTTPStatus.OK, {"status": "ok"})
                else:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "engine thread stopped"})
            elif path in ("/v1/models", "/v1/models/"):
                self._authorized() and self._send(HTTPStatus.OK, server.models())
            elif path.startswith("/v1/models/"):
                if self._authorized():
                    try:  # an id may hold slashes ("org/name") and escapes
                        self._send(
                            HTTPStatus.OK, server.model(urllib.parse.unquote(path[len("/v1/models/") :]))
                        )
                    except RequestError as err:
                        self._error(err)
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route GET {path}", "not_found"))

        def do_POST(self) -> None:  # noqa: N802
            self._body_consumed = False
            route = routes.get(("POST", self.route_path))
            if route is None:
                self._discard_body()
                self._error(
                    RequestError(HTTPStatus.NOT_FOUND, f"no route POST {self.route_path}", "not_found")
                )
                return
            if not self._authorized():
                return
            try:
                result = route(self._body(), self._client_gone)
                if isinstance(result, dict):
                    self._send(HTTPStatus.OK, result)
                else:
                    self._send_events(result)
            except ClientGone:  # nobody to answer: its generation was aborted
                self.close_connection = True
                log.info("a client hung up before its response; its generation was aborted")
            except RequestError as err:
                self._error(err)
            except Exception as err:  # a bug: the request fails, the server stays up
                log.exception("request failed")
                self._error(
                    RequestError(
                        HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(err).__name__}: {err}", "server_error"
                    )
                )

        def _client_gone(self) -> bool:
            return _peer_closed(self.connection)

        def _authorized(self) -> bool:
            if server.api_key is None:
                return True
            scheme, _, token = self.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), server.api_key.encode()
            ):
                return True
            self._discard_body()
            self._error(
                RequestError(HTTPStatus.UNAUTHORIZED, "missing or wrong API key", "authentication_error")
            )
            return False

        def _length(self) -> int | None:
            """The body's length; None where it cannot be read safely (the connection is then closed)."""
            if self.headers.get("Transfer-Encoding"):
                return None
            value = (self.headers.get("Content-Length") or "0").strip()
            return int(value) if value.isdigit() else None

        def _body(self) -> dict[str, Any]:
            self._body_consumed = True
            if self.headers.get("Transfer-Encoding"):
                raise RequestError(
                    HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length (no chunked bodies)"
                )
            length = self._length()
            if length is None:
                raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must be a non-negative integer")
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            try:
                raw = self.rfile.read(length)
            except TimeoutError:  # what did arrive cannot be told from the next request: the connection ends
                self.close_connection = True
                raise RequestError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"the request's body did not arrive within {server.client_io_timeout_s:g} s",
                    "timeout",
                ) from None
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as err:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {err.msg}") from err
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def _discard_body(self) -> None:
            if self._body_consumed:  # already read or dropped: a second read would wait for bytes never sent
                return
            self._body_consumed = True
            length = self._length()
            if length is not None and 0 < length <= MAX_BODY_BYTES:
                self.rfile.read(length)
            else:
                self.close_connection = True

        def _error(self, err: RequestError) -> None:
            self.close_connection = (
                True  # a refused request's body may be unread: do not reuse the connection
            )
            self._send(err.status, err.payload())

        def _send_events(self, events: Iterator[dict[str, Any] | None]) -> None:
            """Server-sent events, then `data: [DONE]`; the connection closes at the end (no length). A None
            is a keep-alive comment, which clients skip."""
            first = next(events)  # a RequestError before any event still becomes a plain error response
            self.close_connection = True
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in itertools.chain([first], events):
                    if event is None:
                        self.wfile.write(b": keep-alive\n\n")
                    else:
                        self.wfile.write(b"data: " + _json(event) + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass  # the client left (or its connection broke): closing the iterator cancels its generation
            finally:
                events.close()  # type: ignore[attr-defined]

        def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = _json(payload)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.debug("%s %s", self.address_string(), format % args)  # the request line only, never a body

    return Handler


def _json(payload: dict[str, Any]) -> bytes:
    """Strict JSON: a NaN or infinity left in a payload (logprobs go through `_logprob`) is a bug that
    fails the request (a 500) instead of sending what strict parsers (JavaScript, serde) reject."""
    return json.dumps(payload, allow_nan=False).encode()
