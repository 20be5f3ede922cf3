"""The `<tool_call>` format: a model's tool calls in its reply, as Qwen's chat templates (Qwen2.5, Qwen3,
Qwen3-MoE), like Hermes', ask for them, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

That is the format read back here (`parse_reply`), by the tool agent (tool_agent.py) and by `miles serve`'s
chat completions (miles/serve/tools.py). A block whose body is not a JSON object with a string `name` (and an
object, or a JSON string of one, as `arguments`) stays in the text, as does an unclosed one: a malformed
call is shown rather than lost. A reply's content is the text outside the calls, each piece stripped of
surrounding whitespace and joined by newlines (None when nothing is left).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, which `json.loads` allows around a value
_PROBE = "miles_probe_tool"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ToolCall]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the tools into the prompt and asks for `<tool_call>`
    blocks (rendering a probe tool: a template that ignores `tools` drops it silently)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or CALL_START not in template:
        return False
    probe = [{"type": "function", "function": {"name": _PROBE, "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=probe, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that fails on tools does not support them
        return False
    return _PROBE in text


def parse_reply(text: str) -> ParsedReply:
    """The calls in a reply and the text around them (the module's docstring).

    A call is `<tool_call>`, one JSON value, then `</tool_call>` (whitespace allowed around the value). The
    value is read as JSON, not up to the next `</tool_call>`, so a closing tag inside one of its strings does
    not cut it short; and an opening that starts no call (a stray or unclosed `<tool_call>`) is text, so a
    well-formed call after it is still found."""
    calls, pieces, last, at = [], [], 0, 0
    while (start := text.find(CALL_START, at)) >= 0:
        at = start + len(CALL_START)
        found = _block_at(text, at)
        if found is None:
            continue  # left in the text
        call, end = found
        pieces.append(text[last:start])
        calls.append(call)
        last = at = end
    pieces.append(text[last:])
    content = "\n".join(p.strip() for p in pieces if p.strip())
    return ParsedReply(content or None, calls)


def _block_at(text: str, body: int) -> tuple[ToolCall, int] | None:
    """(the call whose body starts at `body`, where its `</tool_call>` ends), or None if none starts there."""
    try:
        value, end = _JSON.raw_decode(text, _SPACE.match(text, body).end())
    except json.JSONDecodeError:
        return None
    end = _SPACE.match(text, end).end()
    if not text.startswith(CALL_END, end):
        return None
    call = _call_of(value)
    return None if call is None else (call, end + len(CALL_END))


def _call_of(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], arguments)
