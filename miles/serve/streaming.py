"""`stream: true`: a job's text as OpenAI's server-sent chunks, each choice's as it is generated (a chat reply's
split by `ReplyStream`, chat_reply.py), with keep-alive comments while nothing can go out."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from miles.serve.chat_reply import ReplyFormat, ReplyStream
from miles.serve.worker import Job, wait_s


def chunk_stream(
    job: Job,
    kind: str,
    prefix: str,
    include_usage: bool,
    fmt: ReplyFormat,
    *,
    model_name: str,
    keepalive_s: float,
    timeout_s: float | None,
    cancel: Callable[[Job], None],
) -> Iterator[dict[str, Any] | None]:
    """The stream's chunks; None for a keep-alive comment, sent when nothing else went out for
    `keepalive_s` (a tool call or a partial tag held back, a long prefill): the write is what notices a
    client that hung up, which then stops its generation (`cancel`). `timeout_s`: the longest wait for the
    next event (None: no limit)."""
    ident, created, n = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), job.params.n
    chat = kind == "chat.completion.chunk"
    replies: dict[int, ReplyStream] = {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": ident,
            "object": kind,
            "created": created,
            "model": model_name,
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
        stall_at = None if timeout_s is None else time.monotonic() + timeout_s
        sent_at = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=wait_s(stall_at, keepalive_s))  # type: ignore[union-attr]
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
                    yield chunk([{"index": position * n + index, "delta": delta, "finish_reason": finish}])
                elif time.monotonic() - sent_at >= keepalive_s:  # held back (a tool call, a partial tag)
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
            yield {**chunk([]), "usage": job.usage()}
    finally:
        if not finished:  # the client went away (or the stream stalled): stop generating for it
            cancel(job)
