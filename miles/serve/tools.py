"""Tool calling in `miles serve`'s chat completions: OpenAI's `tools` in, `tool_calls` out.

The tools go to the model's chat template (`apply_chat_template(..., tools=...)`), which tells the model
how to call them, in the `<tool_call>` format read back by rollout/multiturn/tool_calls.py. With tools on,
a message's `content` is the text outside the calls, and `finish_reason` is `tool_calls` when the model
called any. Streaming sends the text before the first call as it comes and the calls when the choice ends
(`ToolCallStream`), so the streamed content and calls are exactly the non-streamed ones.

A forced call (`tool_choice` "required", or a named function) is made by starting the reply with a
call's opening, which the model goes on from: `<tool_call>` and a newline, and for a named function the
start of its JSON, `{"name": "get_weather", "arguments": ` (so only the arguments are the model's). The
opening is put back in front of the reply before it is parsed. Nothing constrains what follows it: a model
that writes a malformed call gets it back in `content`, as with "auto".

History in OpenAI's shape is handed to the template in the shape HF templates read: an assistant message's
`tool_calls` with `function.arguments` parsed from its JSON string, `tool` messages with their content (and
`tool_call_id` / `name` where given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles.rollout.multiturn.tool_calls import CALL_START, ParsedReply, parse_reply


class ToolError(ValueError):
    """A request's tools or tool messages that cannot be used; the message says what to send instead."""


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` (a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}), checked; passed to the chat template as given."""
    if not isinstance(tools, list):
        raise ToolError('\'tools\' must be a list of {"type": "function", "function": {...}}')
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError('each tool must be {"type": "function", "function": {"name": ..., ...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolError("each tool's function needs a non-empty string 'name'")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise ToolError(f"tool {function['name']!r}: 'parameters' must be a JSON Schema object")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """What OpenAI's `tool_choice` asks of a reply."""

    parse: bool
    """The reply's calls are parsed (there are tools, and the choice is not "none")."""
    opening: str = ""
    """The text the reply is made to start with: a call's opening where one is forced, else empty."""
    single: bool = False
    """At most one call (a named function)."""


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI's `tool_choice` over the request's (checked) `tools`: "auto" (the default), "none",
    "required", or {"type": "function", "function": {"name": ...}} naming one of the tools."""
    if choice is None or choice == "auto":
        return ToolChoice(parse=tools is not None)
    if choice == "none":
        return ToolChoice(parse=False)
    function = (
        choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    )
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise ToolError(
            '\'tool_choice\' may be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if tools is None:
        raise ToolError("'tool_choice' forces a call: send the 'tools' it may call")
    if choice == "required":
        return ToolChoice(parse=True, opening=CALL_START + "\n")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise ToolError(f"'tool_choice' names {name!r}, which is not among the tools ({', '.join(names)})")
    return ToolChoice(True, f'{CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ', single=True)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages (content already text) -> the messages HF chat templates read."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant":
                raise ToolError("only assistant messages carry 'tool_calls'")
            m = {**m, "tool_calls": [_template_call(c) for c in _as_list(calls)]}
        out.append(m)
    return out


def _as_list(calls: Any) -> list[Any]:
    if not isinstance(calls, list):
        raise ToolError("'tool_calls' must be a list")
    return calls


def _template_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError('each tool call must be {"type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolError(f"tool call {function['name']!r}: 'arguments' is not JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"tool call {function['name']!r}: 'arguments' must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ToolCallStream:
    """One streamed choice's text with tools on: `feed` returns the content that can go out now (the text
    before anything that may start a call, less leading and trailing whitespace), `finish` the rest of the
    content and the calls, which together are `parse_reply` of the whole text."""

    def __init__(self) -> None:
        self.text, self.sent = "", ""
        self.call_at = -1
        """Where the first `<tool_call>` starts (-1: not seen yet); nothing after it goes out before the end."""

    def feed(self, piece: str) -> str:
        if self.call_at >= 0:
            self.text += piece
            return ""
        start = max(0, len(self.text) - len(CALL_START) + 1)  # a tag may straddle the old end
        self.text += piece
        self.call_at = cut = self.text.find(CALL_START, start)
        if cut < 0:  # hold back a tail that may be the start of a call's tag
            cut = len(self.text) - partial_tag(self.text, CALL_START)
        safe = self.text[:cut].strip()
        new = safe[len(self.sent) :]
        self.sent = safe
        return new

    def finish(self) -> ParsedReply:
        """The calls, and the content not sent yet (as `ParsedReply.content`)."""
        reply = parse_reply(self.text)
        content = reply.content or ""
        assert content.startswith(self.sent), (content, self.sent)  # what was sent is the content's start
        return ParsedReply(content[len(self.sent) :] or None, reply.calls)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (what a stream holds back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
