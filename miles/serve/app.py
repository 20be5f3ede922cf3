"""`EngineServer`: the OpenAI endpoints over the engine (`miles serve`; the package's docstring says what
they take). A request is checked and tokenized (schemas.py), run on the engine's thread (worker.py) and
answered as one JSON object or as server-sent events (streaming.py), over the HTTP side in handlers.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

from miles.rollout import SamplingParams
from miles.rollout.multiturn.tool_calls import template_renders_tools
from miles.sample import Sample, SampleStatus
from miles.serve.chat_reply import ReplyFormat, reply_message
from miles.serve.handlers import CLIENT_IO_TIMEOUT_S, HTTPServer, HTTPServer6, handler_for
from miles.serve.reasoning import prompt_opens_thinking
from miles.serve.schemas import (
    FINISH,
    ClientGone,
    RequestError,
    chat_message,
    chat_messages,
    given,
    logprobs_asked,
    many_prompts,
    request_timeout,
    sampling_params,
    template_refused,
    usage_asked,
)
from miles.serve.streaming import chunk_stream
from miles.serve.tokens import TokenBytes, json_logprob, token_text
from miles.serve.tools import ToolChoice, ToolError, check_tool_choice, check_tools, template_messages
from miles.serve.worker import EngineWorker, Job, wait_s

log = logging.getLogger(__name__)

REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""Both write their thinking between `<think>` and `</think>` (reasoning.py)."""
KEEPALIVE_S = 0.5
"""A stream with nothing to send for this long sends an SSE comment: writing is how a hang-up is noticed."""
CLIENT_POLL_S = 0.25
"""How often a non-streamed request looks whether its client hung up while it waits."""
MAX_SAMPLES_PER_REQUEST = 1024
"""Default cap on a request's samples (its prompts × `n`; `miles serve --max-samples-per-request`): one
request may otherwise queue more generation than the server runs in hours, ahead of everyone else's."""
MAX_CONNECTIONS = 256
"""Default cap on open connections (`miles serve --max-connections`), each holding a thread; past it a new
connection gets a 503 at once and is closed."""


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
        self._renders_tools: bool | None = None
        """Whether the formatter's chat template renders tools in the `<tool_call>` format (probed once)."""
        self._token_bytes: TokenBytes | None = None
        """Each token's bytes, for logprobs (built once, on the engine's thread)."""
        self.worker = EngineWorker(engine)
        self._http_thread: threading.Thread | None = None
        server_class = HTTPServer6 if ":" in host else HTTPServer  # an IPv6 address (::1, ::)
        self.httpd = server_class((host, port), handler_for(self), max_connections)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self.worker.start()
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, name="miles-http", daemon=True)
        self._http_thread.start()

    def serve_forever(self) -> None:
        self.worker.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self._http_thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.worker.stop()

    @property
    def engine_alive(self) -> bool:
        return self.worker.alive

    def on_engine(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the engine's thread (between steps) and return what it returns."""
        return self.worker.on_engine(fn, timeout_s)

    def run(
        self, prompts: list[list[int]], params: SamplingParams, client_gone: Callable[[], bool] | None = None
    ) -> Job:
        """Called from a handler thread: queue the prompts and wait for their samples. `client_gone` is
        asked every `client_poll_s` while it waits: a client that hung up (an SDK's timeout, which then
        retries) would otherwise have its generation run to the end for nobody."""
        job = Job(prompts, params)
        timeout_s = self.request_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.worker.submit(job)
        while not job.done.wait(wait_s(deadline, self.client_poll_s)):
            if client_gone is not None and client_gone():
                self.worker.cancel(job)
                raise ClientGone()
            if deadline is not None and time.monotonic() >= deadline:
                self.worker.cancel(job)
                raise RequestError(
                    HTTPStatus.GATEWAY_TIMEOUT, f"generation took longer than {timeout_s:g} s", "timeout"
                )
        return job

    # requests --------------------------------------------------------------------------------------
    def completions(
        self, body: dict[str, Any], client_gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any] | None]:
        self._check_model(body)
        if body.get("tools") not in (None, []):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'tools' are for /v1/chat/completions")
        prompt = body.get("prompt")
        self._check_sample_count(body, len(prompt) if many_prompts(prompt) else 1)  # before tokenizing
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
                    "finish_reason": FINISH[sample.status],
                    "logprobs": None,
                }
                if logprobs_asked(body, chat=False):
                    choice["logprobs"] = self._completion_logprobs(sample)
                if body.get("return_token_ids"):
                    add_token_ids(choice, sample)
                choices.append(choice)
        return self._envelope("text_completion", "cmpl", choices, job)

    def chat_completions(
        self, body: dict[str, Any], client_gone: Callable[[], bool] | None = None
    ) -> dict[str, Any] | Iterator[dict[str, Any] | None]:
        self._check_model(body)
        messages = [chat_message(m) for m in chat_messages(body.get("messages"))]
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
            message, finish = reply_message(sample.response_text, FINISH[sample.status], fmt)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if logprobs_asked(body, chat=True):
                choice["logprobs"] = self._chat_logprobs(sample)
            if body.get("return_token_ids"):
                add_token_ids(choice, sample)
            choices.append(choice)
        return self._envelope("chat.completion", "chatcmpl", choices, job)

    def _completion_logprobs(self, sample: Sample) -> dict[str, Any]:
        """Completions' logprobs: each token's text and logprob, and its alternatives as {text: logprob}."""
        tokens, alternatives = self._logprob_tokens(sample)
        return {
            "tokens": [token_text(t) for t in tokens],
            "token_logprobs": [json_logprob(lp) for lp in sample.rollout_logprobs],
            "top_logprobs": [
                {token_text(a): json_logprob(lp) for a, (_, lp) in zip(alts, position)}
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
            return {"token": token_text(token), "logprob": json_logprob(logprob), "bytes": list(token)}

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
            if not template_refused(err):
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

        if many_prompts(prompt):
            return [ids_of(p) for p in prompt]
        return [ids_of(prompt)]

    def _check_sample_count(self, body: dict[str, Any], prompts: int) -> None:
        """A 400 for a request asking for more than `max_samples_per_request` samples (prompts × `n`)."""
        n = given(body, "n", 1)
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
    ) -> Job:
        params = sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
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
        if logprobs_asked(body, chat) or body.get("return_token_ids"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "logprobs and return_token_ids need stream=false")
        include_usage = usage_asked(body.get("stream_options"))
        params = sampling_params(body, default_max_tokens, self.engine.max_context, prompts)
        # Refused before any event, as a non-streamed request would be (the engine's own checks).
        problems = self.on_engine(lambda: [self.engine.validate_prompt(ids) for ids in prompts])
        for problem in problems:
            if problem is not None:
                raise RequestError(HTTPStatus.BAD_REQUEST, problem)
        job = Job(prompts, params, events=queue.Queue())
        self.worker.submit(job)
        return self.events(job, kind, prefix, include_usage, fmt or ReplyFormat())

    def events(
        self, job: Job, kind: str, prefix: str, include_usage: bool, fmt: ReplyFormat
    ) -> Iterator[dict[str, Any] | None]:
        """The chunks of `job`'s stream (streaming.py), with this server's model name and time limits."""
        return chunk_stream(
            job,
            kind,
            prefix,
            include_usage,
            fmt,
            model_name=self.model_name,
            keepalive_s=self.keepalive_s,
            timeout_s=self.request_timeout_s,
            cancel=self.worker.cancel,
        )

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's text, as logprobs show it (`token_text` of its bytes)."""
        return [token_text(b) for b in self._token_bytes_of(ids)]

    def _envelope(self, kind: str, prefix: str, choices: list[dict[str, Any]], job: Job) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": job.usage(),
        }


def add_token_ids(choice: dict[str, Any], sample: Sample) -> None:
    """`return_token_ids`: the prompt's and the choice's token ids (token-in/token-out clients)."""
    choice["prompt_token_ids"] = list(sample.prompt_ids)
    choice["token_ids"] = list(sample.response_ids)
