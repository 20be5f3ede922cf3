"""An OpenAI-compatible HTTP server over the embedded engine: `miles serve`.

`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`. One thread owns the
engine and steps it while any request is in flight; HTTP handler threads hand it their prompts and wait,
so concurrent requests share engine steps (continuous batching) and the radix cache. Binds 127.0.0.1 unless
told otherwise; with an API key set, every request needs `Authorization: Bearer <key>`. Request bodies and
keys are never logged.

Beyond OpenAI's fields, a request may set `top_k`, `min_p`, `ignore_eos`, `stop_token_ids` and
`return_token_ids` (the prompt's and each choice's token ids, for token-in/token-out clients). `logprobs`
returns the sampled tokens' logprobs, under the distribution they were sampled from (temperature, top-p...:
the engine's convention, docs/rollout.md), with up to 20 alternatives per token under the same distribution
(completions: `logprobs: N`; chat: `logprobs: true, top_logprobs: N`). `stream: true` sends server-sent events
(OpenAI's chunks, then `data: [DONE]`; `stream_options.include_usage` adds the usage), holding back the
last characters while a stop string could still take them back; a client that hangs up stops its
generation. Chat completions take `tools` (with `tool_choice` "auto" or "none", and `parallel_tool_calls`),
`tool_calls` in assistant messages and `tool` messages, and return the model's calls as `tool_calls`, streamed
or not, where the model's chat template renders tools in Qwen's `<tool_call>` format (tool_calls.py); with a
reasoning parser, a thinking model's `<think>` block comes back as `reasoning_content` (reasoning.py). Not
supported, and refused with a 400 rather than ignored: `echo`, `suffix`, `best_of` > 1, logprobs or token ids
with streaming, non-zero `frequency_penalty` / `presence_penalty`, `logit_bias`, a forced tool call
(`tool_choice` "required" or a named function), the legacy `functions` / `function_call`, and
`response_format`. Chat content may be a string or text parts. Tokenizing runs on the engine's thread
(the tokenizer is the engine's); a request waiting past `request_timeout_s` gets a 504 and what it still
runs is aborted.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import queue
import threading
import time
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


class RequestError(Exception):
    """A request the server refuses: its status and an OpenAI-style error body."""

    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


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
        request_timeout_s: float = 3600.0,
        reasoning_parser: str | None = None,
    ) -> None:
        """`reasoning_parser`: "qwen3" (or "deepseek_r1", the same `<think>` tags) splits chat replies'
        thinking off as `reasoning_content` (reasoning.py); None leaves it in the content."""
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; use one of {REASONING_PARSERS}")
        self.reasoning = reasoning_parser is not None
        self.engine, self.formatter, self.model_name = engine, formatter, model_name
        self.api_key = api_key or None
        self.request_timeout_s = request_timeout_s
        self._jobs: queue.Queue[_Job | _Task] = queue.Queue()
        self._stop = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="miles-engine", daemon=True)
        self._http_thread: threading.Thread | None = None
        self._renders_tools: bool | None = None
        """Whether the formatter's chat template renders tools in the `<tool_call>` format (probed once)."""
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

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

    def run(self, prompts: list[list[int]], params: SamplingParams) -> _Job:
        """Called from a handler thread: queue the prompts and wait for their samples."""
        job = _Job(prompts, params)
        self._jobs.put(job)
        timeout_s = self.request_timeout_s
        if not job.done.wait(timeout_s):
            job.cancelled = True  # the engine thread aborts what is left of it
            self._jobs.put(job)
            raise RequestError(
                HTTPStatus.GATEWAY_TIMEOUT, f"generation took longer than {timeout_s:.0f} s", "timeout"
            )
        return job

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
        decoder.update(self.engine.tokenizer, sample.response_ids, final=True)
        text = decoder.text
        cuts = [i for i in (text.find(stop) for stop in job.params.stop) if i >= 0]
        if cuts and sample.status == SampleStatus.COMPLETED:  # the engine stopped on a stop string
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
    def completions(self, body: dict[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        self._check_model(body)
        if body.get("tools") not in (None, []):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'tools' are for /v1/chat/completions")
        prompt = body.get("prompt")
        prompts = self.on_engine(lambda: self._prompt_ids(prompt))
        if body.get("stream"):
            return self._stream(prompts, body, 16, "text_completion", "cmpl")
        job = self._generate(prompts, body, default_max_tokens=16)
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
                if body.get("logprobs") not in (None, False):  # an int: the alternatives per token
                    choice["logprobs"] = {
                        "tokens": self._token_strings(sample.response_ids),
                        "token_logprobs": list(sample.rollout_logprobs),
                        "top_logprobs": [
                            dict(zip(self._token_strings([t for t, _ in alts]), (lp for _, lp in alts)))
                            for alts in sample.top_logprobs
                        ]
                        if sample.top_logprobs is not None
                        else None,
                        "text_offset": None,
                    }
                if body.get("return_token_ids"):
                    _add_token_ids(choice, sample)
                choices.append(choice)
        return self._envelope("text_completion", "cmpl", choices, job)

    def chat_completions(self, body: dict[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        self._check_model(body)
        messages = [_message(m) for m in _messages(body.get("messages"))]
        if self.engine.tokenizer is None:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, "this model has no tokenizer: use /v1/completions with ids"
            )
        messages, tools, parse_calls = self._tools(body, messages)
        prompts = [self.on_engine(lambda: self.formatter.ids(messages, tools))]
        fmt = ReplyFormat(
            reasoning=self.reasoning,
            thinking=self.reasoning and self.on_engine(lambda: self._opens_thinking(prompts[0])),
            tool_calls=parse_calls,
            call_limit=1 if body.get("parallel_tool_calls") is False else None,
        )
        if body.get("stream"):
            return self._stream(prompts, body, None, "chat.completion.chunk", "chatcmpl", fmt)
        job = self._generate(prompts, body, default_max_tokens=None)
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
            if body.get("logprobs"):
                tokens = self._token_strings(sample.response_ids)
                alternatives = sample.top_logprobs or [[] for _ in tokens]
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": t,
                            "logprob": lp,
                            "bytes": list(t.encode()),
                            "top_logprobs": [
                                {"token": a, "logprob": alp, "bytes": list(a.encode())}
                                for a, (_, alp) in zip(self._token_strings([i for i, _ in alts]), alts)
                            ],
                        }
                        for t, lp, alts in zip(tokens, sample.rollout_logprobs, alternatives)
                    ]
                }
            if body.get("return_token_ids"):
                _add_token_ids(choice, sample)
            choices.append(choice)
        return self._envelope("chat.completion", "chatcmpl", choices, job)

    def _tools(
        self, body: dict[str, Any], messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
        """(messages for the chat template, tools for it, whether to parse the reply's calls)."""
        try:
            tools = check_tools(body["tools"]) if body.get("tools") not in (None, []) else None
            parse_calls = tools is not None and check_tool_choice(body.get("tool_choice"))
            history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
            if (tools is not None or history) and not self.on_engine(self._check_renders_tools):
                raise ToolError(
                    "this model's chat template does not render tools in the <tool_call> format (Qwen2.5, "
                    "Qwen3 and Hermes templates do); send the tools in a message's text instead"
                )
            return template_messages(messages), tools if parse_calls else None, parse_calls
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
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles"}],
        }

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

        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            return [ids_of(p) for p in prompt]
        return [ids_of(prompt)]

    def _generate(
        self, prompts: list[list[int]], body: dict[str, Any], default_max_tokens: int | None
    ) -> _Job:
        params = _sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
        job = self.run(prompts, params)
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
    ) -> Iterator[dict[str, Any]]:
        """Server-sent events: the text of each choice as it is generated (OpenAI's chunk objects); a chat
        reply's as `fmt` says (chat_reply.py)."""
        if self.engine.tokenizer is None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "streaming needs a tokenizer; send stream=false")
        if body.get("logprobs") not in (None, False, 0) or body.get("return_token_ids"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "logprobs and return_token_ids need stream=false")
        params = _sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
        # Refused before any event, as a non-streamed request would be (the engine's own checks).
        problems = self.on_engine(lambda: [self.engine.validate_prompt(ids) for ids in prompts])
        for problem in problems:
            if problem is not None:
                raise RequestError(HTTPStatus.BAD_REQUEST, problem)
        job = _Job(prompts, params, events=queue.Queue())
        self._jobs.put(job)
        options = body.get("stream_options") or {}
        return self._events(job, kind, prefix, bool(options.get("include_usage")), fmt or ReplyFormat())

    def _events(
        self, job: _Job, kind: str, prefix: str, include_usage: bool, fmt: ReplyFormat
    ) -> Iterator[dict[str, Any]]:
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
            while True:
                try:
                    event = job.events.get(timeout=self.request_timeout_s)  # type: ignore[union-attr]
                except queue.Empty:
                    yield {
                        "error": {"message": "generation stalled past the request timeout", "type": "timeout"}
                    }
                    return
                if event is None:
                    break
                position, index, text, finish = event
                if chat:
                    reply = replies.setdefault(position * n + index, ReplyStream(fmt))
                    delta, finish = reply.delta(text, finish)
                    if delta or finish is not None:
                        yield chunk(
                            [{"index": position * n + index, "delta": delta, "finish_reason": finish}]
                        )
                else:
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
                job.cancelled = True
                self._jobs.put(job)

    def _token_strings(self, ids: list[int]) -> list[str]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return [str(t) for t in ids]
        return self.on_engine(lambda: [tokenizer.decode([t]) for t in ids])

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


def _sampling_params(
    body: dict[str, Any], default_max_tokens: int | None, max_context: int, prompts: list[list[int]]
) -> SamplingParams:
    for key, off in (("echo", False), ("suffix", None), ("logit_bias", None)):
        if body.get(key) not in (off, None, {}):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} is not supported")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} is not supported (only 0)")
    if body.get("best_of") not in (None, 1):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'best_of' > 1 is not supported")
    for key in ("functions", "function_call", "response_format"):
        if body.get(key) not in (None, [], "none"):
            hint = "send 'tools' instead" if key.startswith("function") else "no JSON mode"
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} is not supported ({hint})")
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
        return SamplingParams(
            n=int(_given(body, "n", 1)),
            temperature=float(_given(body, "temperature", 1.0)),
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
    except (TypeError, ValueError) as err:
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


def _handler_for(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    routes = {
        ("POST", "/v1/completions"): server.completions,
        ("POST", "/v1/chat/completions"): server.chat_completions,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
                self._discard_body()  # else a body would be read as the next request on this connection
            if self.path == "/health":
                if server.engine_alive:
                    self._send(HTTPStatus.OK, {"status": "ok"})
                else:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "engine thread stopped"})
            elif self.path == "/v1/models":
                self._authorized() and self._send(HTTPStatus.OK, server.models())
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route GET {self.path}", "not_found"))

        def do_POST(self) -> None:  # noqa: N802
            route = routes.get(("POST", self.path))
            if route is None:
                self._discard_body()
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route POST {self.path}", "not_found"))
                return
            if not self._authorized():
                return
            try:
                result = route(self._body())
                if isinstance(result, dict):
                    self._send(HTTPStatus.OK, result)
                else:
                    self._send_events(result)
            except RequestError as err:
                self._error(err)
            except Exception as err:  # a bug: the request fails, the server stays up
                log.exception("request failed")
                self._error(
                    RequestError(
                        HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(err).__name__}: {err}", "server_error"
                    )
                )

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
            if self.headers.get("Transfer-Encoding"):
                raise RequestError(
                    HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length (no chunked bodies)"
                )
            length = self._length()
            if length is None:
                raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must be a non-negative integer")
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as err:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {err.msg}") from err
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def _discard_body(self) -> None:
            length = self._length()
            if length is not None and 0 < length <= MAX_BODY_BYTES:
                self.rfile.read(length)
            else:
                self.close_connection = True

        def _error(self, err: RequestError) -> None:
            self.close_connection = (
                True  # a refused request's body may be unread: do not reuse the connection
            )
            self._send(
                err.status, {"error": {"message": err.message, "type": err.kind, "code": int(err.status)}}
            )

        def _send_events(self, events: Iterator[dict[str, Any]]) -> None:
            """Server-sent events, then `data: [DONE]`; the connection closes at the end (no length)."""
            first = next(events)  # a RequestError before any event still becomes a plain error response
            self.close_connection = True
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in itertools.chain([first], events):
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass  # the client left (or its connection broke): closing the iterator cancels its generation
            finally:
                events.close()  # type: ignore[attr-defined]

        def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
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
