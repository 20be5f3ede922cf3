"""How a chat reply's text becomes OpenAI's assistant message in `miles serve`, streamed or not: the thinking
block split off as `reasoning_content` (reasoning.py, with `--reasoning-parser`), then the tool calls of
what remains (tools.py, when the request has tools). Either way the streamed deltas add up to the
non-streamed message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.rollout.multiturn.tool_calls import ToolCall, parse_reply
from miles.serve.reasoning import ReasoningStream, split_reasoning
from miles.serve.tools import ToolCallStream


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: bool = False
    """Split off the thinking block (`--reasoning-parser`)."""
    thinking: bool = False
    """The prompt ended inside a thinking block (its template opened it)."""
    tool_calls: bool = False
    """Parse the reply's tool calls (the request has tools, `tool_choice` not "none")."""
    call_limit: int | None = None
    """Calls returned at most (1 with `parallel_tool_calls: false` or a named `tool_choice`)."""
    opening: str = ""
    """What the reply was made to start with (a forced call's opening, tools.py), put back in front of
    the model's text."""

    def calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        return [call.to_openai() for call in calls[: self.call_limit]]


def reply_message(text: str, finish: str, fmt: ReplyFormat) -> tuple[dict[str, Any], str]:
    """(the assistant message, the finish reason) of a whole reply."""
    text = fmt.opening + text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if fmt.reasoning:
        message["reasoning_content"], message["content"] = split_reasoning(text, fmt.thinking)
    if fmt.tool_calls:
        reply = parse_reply(message["content"])
        message["content"] = reply.content
        if reply.calls:
            message["tool_calls"] = fmt.calls(reply.calls)
            finish = "tool_calls" if finish == "stop" else finish
    return message, finish


class ReplyStream:
    """One streamed choice: each piece of text becomes the delta that can go out now."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self.fmt = fmt
        self.reasoning = ReasoningStream(fmt.thinking) if fmt.reasoning else None
        self.tools = ToolCallStream() if fmt.tool_calls else None
        self.opening = fmt.opening

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta for `text`, the finish reason); `finish` set: the choice's last piece."""
        delta: dict[str, Any] = {}
        text, self.opening = self.opening + text, ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if finish is not None:
                more, rest = self.reasoning.finish()
                thought, text = thought + more, text + rest
            if thought:
                delta["reasoning_content"] = thought
        calls = []
        if self.tools is not None:
            text = self.tools.feed(text)
            if finish is not None:
                reply = self.tools.finish()
                text, calls = text + (reply.content or ""), reply.calls
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self.fmt.calls(calls))]
            finish = "tool_calls" if finish == "stop" else finish
        return delta, finish
