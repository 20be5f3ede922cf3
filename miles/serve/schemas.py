"""What a request body may ask for, checked: OpenAI's fields into `SamplingParams`, chat messages into the
chat template's, and the refusals (`RequestError`, a 4xx with OpenAI's error body)."""

from __future__ import annotations

import math
import sys
from http import HTTPStatus
from typing import Any

from miles.rollout import SamplingParams
from miles.rollout.sampling.sampler import MAX_TOP_LOGPROBS
from miles.sample import SampleStatus

FINISH = {SampleStatus.COMPLETED: "stop", SampleStatus.TRUNCATED: "length"}
"""OpenAI's `finish_reason` of a finished sample's status."""

GREEDY_BELOW = 1e-5
"""A temperature under this samples greedily: logits divided by a smaller one overflow float32 (NaN)."""
NO_OPS: dict[str, tuple[tuple[Any, ...], str]] = {
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


def request_timeout(seconds: float | None) -> float | None:
    """A request's time limit: > 0 seconds, or None for none (inf, a natural "no limit", is None: waiting
    `inf` seconds raises in Python's threading)."""
    if seconds is None or seconds == math.inf:
        return None
    if not 0 < seconds < math.inf:  # NaN fails too
        raise ValueError(f"request_timeout_s must be > 0 seconds (inf: no limit), got {seconds}")
    return float(seconds)


def template_refused(err: BaseException) -> bool:
    """Whether `err` is a chat template refusing the conversation: jinja2's TemplateError, which the
    templates' `raise_exception` raises, but not a TemplateSyntaxError (a template that does not parse)."""
    jinja2 = sys.modules.get("jinja2")  # loaded by whatever rendered the template; not loaded: none did
    if jinja2 is None:
        return False
    return isinstance(err, jinja2.TemplateError) and not isinstance(err, jinja2.TemplateSyntaxError)


def logprobs_asked(body: dict[str, Any], chat: bool) -> bool:
    """Whether the request asks for logprobs. Chat's `logprobs` is a boolean; completions' an integer, 0
    included (the sampled tokens' logprobs, no alternatives), so only null or false turn it off there."""
    value = body.get("logprobs")
    return bool(value) if chat else value is not None and value is not False


def usage_asked(options: Any) -> bool:
    """`stream_options.include_usage`; anything but an object (or null) is a 400, checked before the job
    is queued."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, "'stream_options' must be an object, e.g. {\"include_usage\": true}"
        )
    return bool(options.get("include_usage"))


def sampling_params(
    body: dict[str, Any], default_max_tokens: int | None, max_context: int, prompts: list[list[int]]
) -> SamplingParams:
    for key, (no_ops, message) in NO_OPS.items():
        if body.get(key) is not None and body[key] not in no_ops:
            raise RequestError(HTTPStatus.BAD_REQUEST, message)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} is not supported (only 0)")
    if body.get("best_of") not in (None, 1):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'best_of' > 1 is not supported")
    alternatives = alternatives_asked(body)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is None:  # chat: up to the end of the context
        max_tokens = max(1, max_context - max(len(p) for p in prompts))
    stop = body.get("stop") or []
    try:
        temperature = float(given(body, "temperature", 1.0))
        return SamplingParams(
            n=int(given(body, "n", 1)),
            temperature=0.0 if 0 < temperature < GREEDY_BELOW else temperature,
            top_p=float(given(body, "top_p", 1.0)),
            top_k=int(given(body, "top_k", -1)),
            min_p=float(given(body, "min_p", 0.0)),
            max_new_tokens=int(max_tokens),
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=[int(t) for t in body.get("stop_token_ids") or []],
            seed=None if body.get("seed") is None else int(body["seed"]),
            ignore_eos=bool(given(body, "ignore_eos", False)),
            top_logprobs=alternatives,
        )
    except (TypeError, ValueError, OverflowError) as err:  # OverflowError: int() of Infinity or 1e999
        raise RequestError(HTTPStatus.BAD_REQUEST, f"bad sampling parameter: {err}") from err


def alternatives_asked(body: dict[str, Any]) -> int:
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


def many_prompts(prompt: Any) -> bool:
    """Whether a completions `prompt` is a list of prompts (strings or id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)


def given(body: dict[str, Any], key: str, default: Any) -> Any:
    """`body[key]`, or `default` where it is absent or null (OpenAI's fields are nullable)."""
    value = body.get(key)
    return default if value is None else value


def chat_messages(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list of {role, content}")
    return messages


def chat_message(m: Any) -> dict[str, Any]:
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
