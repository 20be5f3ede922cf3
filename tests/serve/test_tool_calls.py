"""Tool calling and reasoning in `miles serve` (miles/serve/tools.py, reasoning.py, chat_reply.py): tools
rendered by the chat template, `<tool_call>` blocks parsed back into OpenAI's `tool_calls`, `<think>` blocks
split off as `reasoning_content`, the same message streamed or not."""

from __future__ import annotations

import copy
import json
import queue
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from miles.config import DataConfig, RolloutConfig
from miles.data import PromptFormatter
from miles.model_io import load_model
from miles.rollout import Engine, SamplingParams
from miles.rollout.multiturn.tool_calls import parse_reply, template_renders_tools
from miles.sample import Sample, SampleStatus
from miles.serve.app import EngineServer
from miles.serve.chat_reply import ReplyFormat, ReplyStream, reply_message
from miles.serve.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning
from miles.serve.tools import (
    ToolCallStream,
    ToolChoice,
    ToolError,
    check_tool_choice,
    check_tools,
    template_messages,
)
from miles.serve.worker import Job
from tests.serve.test_server import call, raw_request, scripted_server, wait_idle

# A ChatML template that renders tools and tool turns as Qwen's do (written for these tests).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    '\n</tools>\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    '{% for c in message.tool_calls %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
REPLIES = [
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
    '"{\\"x\\": [1, 2]}"}\n</tool_call>',
    "  No call here: 1 < 2 and <tool is not a tag.  ",
    'Broken: <tool_call>\n{"name": oops}\n</tool_call> then <tool_call>{"name": "ok", "arguments": {}}'
    "</tool_call> after",
    'Unclosed <tool_call>\n{"name": "f", "arguments": {}}',
    "",
]


@pytest.fixture(scope="module")
def tool_server() -> Iterator[EngineServer]:
    loaded = load_model("builtin:tiny_moe_math")
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    engine = Engine(loaded.model, tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    server = EngineServer(engine, PromptFormatter(tokenizer, DataConfig()), "tiny", port=0)
    server.start()
    yield server
    server.shutdown()


def test_calls_and_the_text_around_them_are_parsed() -> None:
    one = parse_reply(REPLIES[0])
    assert one.content == "Let me look." and [(c.name, c.arguments) for c in one.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    wire = one.calls[0].to_openai()
    assert wire["type"] == "function" and wire["id"].startswith("call_")
    assert json.loads(wire["function"]["arguments"]) == {"city": "Paris"}
    two = parse_reply(REPLIES[1])  # arguments as a JSON string are read too
    assert two.content is None and [(c.name, c.arguments) for c in two.calls] == [
        ("a", {}),
        ("b", {"x": [1, 2]}),
    ]
    assert len({c.id for c in two.calls}) == 2
    assert parse_reply(REPLIES[2]).content == REPLIES[2].strip() and not parse_reply(REPLIES[2]).calls
    broken = parse_reply(REPLIES[3])  # a malformed block stays in the text; the good one is a call
    assert [c.name for c in broken.calls] == ["ok"]
    assert broken.content == 'Broken: <tool_call>\n{"name": oops}\n</tool_call> then\nafter'
    unclosed = parse_reply(REPLIES[4])
    assert unclosed.content == REPLIES[4] and not unclosed.calls
    assert parse_reply("").content is None


EDGE_REPLIES = [
    # A stray opening before a well-formed call: the opening is text, the call is a call.
    'I will use <tool_call> now.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    # A closing tag (and an opening one) inside a JSON string does not end the call.
    '<tool_call>\n{"name": "write", "arguments": {"text": "wrap it in </tool_call> or <tool_call>"}}\n'
    "</tool_call> done",
    # Nested braces (one inside a string) and non-ASCII text.
    '<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}, "city": "Zürich 🙂"}}</tool_call>',
    # Text between the JSON value and the closing tag: not a call.
    '<tool_call>\n{"name": "f"} and more\n</tool_call>',
]


def test_calls_are_read_as_json_not_up_to_the_next_tag() -> None:
    stray = parse_reply(EDGE_REPLIES[0])
    assert [(c.name, c.arguments) for c in stray.calls] == [("f", {"a": 1})]
    assert stray.content == "I will use <tool_call> now."
    inside = parse_reply(EDGE_REPLIES[1])
    assert [(c.name, c.arguments) for c in inside.calls] == [
        ("write", {"text": "wrap it in </tool_call> or <tool_call>"})
    ]
    assert inside.content == "done"
    nested = parse_reply(EDGE_REPLIES[2])
    assert [(c.name, c.arguments) for c in nested.calls] == [
        ("f", {"a": {"b": [1, {"c": "}"}]}, "city": "Zürich 🙂"})
    ]
    assert nested.content is None
    trailing = parse_reply(EDGE_REPLIES[3])
    assert not trailing.calls and trailing.content == EDGE_REPLIES[3]


@pytest.mark.parametrize("seed", range(4))
def test_streamed_pieces_add_up_to_the_parsed_reply(seed: int) -> None:
    """However the text arrives, the content sent as it comes plus what `finish` adds is the parsed content,
    the calls are the parsed calls, and nothing of a call is sent before the end."""
    rng = random.Random(seed)
    for text in [*REPLIES, *EDGE_REPLIES]:
        stream, sent, cuts = (
            ToolCallStream(),
            "",
            sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1))),
        )
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] if seed else list(text)
        for piece in pieces:
            sent += stream.feed(piece)
            assert "<tool_" not in sent or "<tool_call>" not in text, (text, sent)
        end, want = stream.finish(), parse_reply(text)
        assert sent + (end.content or "") == (want.content or "")
        assert [(c.name, c.arguments) for c in end.calls] == [(c.name, c.arguments) for c in want.calls]


def test_tools_and_tool_history_are_checked_and_converted() -> None:
    assert check_tools([WEATHER]) == [WEATHER]
    for bad, message in [
        ({"type": "function"}, "must be a list"),
        ([{"type": "code_interpreter"}], "each tool must be"),
        ([{"type": "function", "function": {"name": ""}}], "non-empty string 'name'"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "JSON Schema object"),
    ]:
        with pytest.raises(ToolError, match=message):
            check_tools(bad)
    tools = [WEATHER]
    assert check_tool_choice(None, tools) == check_tool_choice("auto", tools) == ToolChoice(parse=True)
    assert check_tool_choice(None, None) == check_tool_choice("none", tools) == ToolChoice(parse=False)
    assert check_tool_choice("required", tools) == ToolChoice(True, "<tool_call>\n")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, tools) == ToolChoice(
        True, '<tool_call>\n{"name": "get_weather", "arguments": ', single=True
    )
    for bad, message in [
        ("always", "may be"),
        ({"type": "function"}, "may be"),
        ("required", "send the 'tools'"),
        ({"type": "function", "function": {"name": "get_time"}}, "not among the tools"),
    ]:
        with pytest.raises(ToolError, match=message):
            check_tool_choice(bad, tools if message != "send the 'tools'" else None)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    converted = template_messages(history)
    assert converted[1]["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            "id": "call_1",
        }
    ]
    assert converted[0] == history[0] and converted[2] == history[2]
    bad_json = copy.deepcopy(history)
    bad_json[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    with pytest.raises(ToolError, match="not JSON"):
        template_messages(bad_json)
    with pytest.raises(ToolError, match="only assistant messages"):
        template_messages([{"role": "user", "content": "x", "tool_calls": [{}]}])


def test_only_templates_that_render_tools_as_tool_call_blocks_take_them() -> None:
    loaded = load_model("builtin:tiny_moe_math")
    assert not template_renders_tools(loaded.tokenizer)  # ChatML without tools
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(tokenizer)
    # Mentions the tag but drops the tools: not taken.
    tokenizer.chat_template = loaded.tokenizer.chat_template + "{# <tool_call> #}"
    assert not template_renders_tools(tokenizer)


def test_the_prompt_holds_the_tools_and_the_tool_turns(tool_server: EngineServer) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    body = {"messages": history, "tools": [WEATHER], "max_tokens": 8, "seed": 1, "return_token_ids": True}
    status, out = call(tool_server, "/v1/chat/completions", body)
    assert status == 200, out
    prompt = tool_server.engine.tokenizer.decode(out["choices"][0]["prompt_token_ids"])
    assert json.dumps(WEATHER) in prompt  # the template's tojson of the tool, as given
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    # tool_choice "none": the tools stay out of the prompt and the reply is plain text.
    status, none = call(tool_server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert status == 200 and "<tools>" not in tool_server.engine.tokenizer.decode(
        none["choices"][0]["prompt_token_ids"]
    )
    assert "tool_calls" not in none["choices"][0]["message"]


def test_tool_requests_the_server_refuses(tool_server: EngineServer) -> None:
    user = [{"role": "user", "content": "hi"}]
    for path, body, message in [
        (
            "/v1/chat/completions",
            {
                "messages": user,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "not among the tools",
        ),
        ("/v1/chat/completions", {"messages": user, "tool_choice": "required"}, "send the 'tools'"),
        ("/v1/chat/completions", {"messages": user, "tools": [{"type": "function"}]}, "each tool must be"),
        (
            "/v1/chat/completions",
            {"messages": user, "functions": [WEATHER["function"]]},
            "send 'tools' instead",
        ),
        ("/v1/completions", {"prompt": "x", "tools": [WEATHER]}, "/v1/chat/completions"),
    ]:
        status, out = call(tool_server, path, body)
        assert status == 400 and message in out["error"]["message"], (body, out)


def replying(monkeypatch: Any, text: str, status: SampleStatus = SampleStatus.COMPLETED) -> None:
    """The server's generation returns a sample of `text` (the tiny model does not call tools)."""

    def generate(
        self: EngineServer,
        prompts: list[list[int]],
        body: dict,
        default_max_tokens: int | None,
        client_gone: Any = None,
    ) -> Job:
        job = Job(prompts, SamplingParams(n=1))
        job.results[0, 0] = Sample(prompt_ids=prompts[0], response_text=text, status=status)
        return job

    monkeypatch.setattr(EngineServer, "_generate", generate)


def test_a_reply_s_calls_come_back_as_tool_calls(tool_server: EngineServer, monkeypatch: Any) -> None:
    """The model's reply (set by `replying`) becomes OpenAI's message, streamed
    or not, with the same content and calls."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    for text, finish in [(REPLIES[0], "tool_calls"), (REPLIES[1], "tool_calls"), ("Sunny.", "stop")]:
        replying(monkeypatch, text)
        status, out = call(tool_server, "/v1/chat/completions", {"messages": user, "tools": [WEATHER]})
        assert status == 200, out
        message, want = out["choices"][0]["message"], parse_reply(text)
        assert out["choices"][0]["finish_reason"] == finish and message["content"] == want.content
        calls = message.get("tool_calls", [])
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c.name, c.arguments) for c in want.calls
        ]
        # Streamed: the events of a choice whose text arrives in pieces.
        job = Job([[1, 2]], SamplingParams(n=1), events=queue.Queue())
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)] or [""]
        for piece in pieces[:-1]:
            job.events.put((0, 0, piece, None))
        job.events.put((0, 0, pieces[-1], "stop"))
        job.events.put(None)
        chunks = list(
            tool_server.events(job, "chat.completion.chunk", "chatcmpl", False, ReplyFormat(tool_calls=True))
        )
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        content = "".join(d["delta"].get("content", "") for d in deltas)
        streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
        assert (content or None) == want.content and deltas[-1]["finish_reason"] == finish
        assert [
            (c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed
        ] == [(i, c.name, c.arguments) for i, c in enumerate(want.calls)]
    # parallel_tool_calls=false keeps the first call.
    replying(monkeypatch, REPLIES[1])
    body = {"messages": user, "tools": [WEATHER], "parallel_tool_calls": False}
    status, out = call(tool_server, "/v1/chat/completions", body)
    assert status == 200 and [c["function"]["name"] for c in out["choices"][0]["message"]["tool_calls"]] == [
        "a"
    ]
    # A reply cut by the length limit keeps its finish reason.
    replying(monkeypatch, REPLIES[0], SampleStatus.TRUNCATED)
    status, out = call(tool_server, "/v1/chat/completions", {"messages": user, "tools": [WEATHER]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"


def test_a_forced_call_starts_the_reply_and_comes_back_as_tool_calls(
    tool_server: EngineServer, monkeypatch: Any
) -> None:
    """tool_choice "required" or a named function: the prompt ends with the call's opening, which goes back in
    front of the model's text, so the calls come back, streamed or not (a named function's one call only); a
    malformed continuation stays in the content."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": user, "tools": [WEATHER], "max_tokens": 4, "return_token_ids": True}
    for choice, opening in [
        ("required", "<tool_call>\n"),
        (named, '<tool_call>\n{"name": "get_weather", "arguments": '),
    ]:
        status, out = call(tool_server, "/v1/chat/completions", {**body, "tool_choice": choice})
        assert status == 200, out
        prompt = tool_server.engine.tokenizer.decode(out["choices"][0]["prompt_token_ids"])
        assert prompt.endswith("<|im_start|>assistant\n" + opening)
    rest = '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for choice, text, cities in [
        ("required", '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ["Paris"]),
        (named, rest, ["Paris"]),  # one call for a named function
    ]:
        replying(monkeypatch, text)
        status, out = call(
            tool_server, "/v1/chat/completions", {"messages": user, "tools": [WEATHER], "tool_choice": choice}
        )
        assert status == 200, out
        message = out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
        assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == cities
        opening = check_tool_choice(choice, [WEATHER])
        fmt = ReplyFormat(tool_calls=True, call_limit=1 if opening.single else None, opening=opening.opening)
        job = Job([[1, 2]], SamplingParams(n=1), events=queue.Queue())
        for i in range(0, len(text), 7):
            job.events.put((0, 0, text[i : i + 7], None))
        job.events.put((0, 0, "", "stop"))
        job.events.put(None)
        chunks = [c for c in tool_server.events(job, "chat.completion.chunk", "chatcmpl", False, fmt) if c]
        streamed = [
            tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])
        ]
        assert [json.loads(c["function"]["arguments"])["city"] for c in streamed] == cities
    replying(monkeypatch, "Paris, I think")  # not JSON: the opening and the text stay in the content
    status, out = call(
        tool_server, "/v1/chat/completions", {"messages": user, "tools": [WEATHER], "tool_choice": named}
    )
    message = out["choices"][0]["message"]
    assert status == 200 and "tool_calls" not in message and out["choices"][0]["finish_reason"] == "stop"
    assert message["content"] == '<tool_call>\n{"name": "get_weather", "arguments": Paris, I think'


def test_a_held_back_tool_call_streams_keep_alives(tool_server: EngineServer) -> None:
    """While a `<tool_call>` block is generated nothing of it can be sent: a keep-alive goes out instead
    (a comment clients skip), as a write is how a client's hang-up is noticed."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    job = Job([[1, 2]], SamplingParams(n=1), events=queue.Queue())
    for i in range(len(text)):
        job.events.put((0, 0, text[i], None))
    job.events.put((0, 0, "", "stop"))
    job.events.put(None)
    tool_server.keepalive_s = 0.0  # every empty delta: the throttle is timing's, not this test's
    try:
        events = list(
            tool_server.events(job, "chat.completion.chunk", "chatcmpl", False, ReplyFormat(tool_calls=True))
        )
    finally:
        tool_server.keepalive_s = 0.5
    chunks = [e for e in events if e is not None]
    assert events.count(None) > 20 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == parse_reply(text).content


def test_a_client_that_hangs_up_inside_a_tool_call_stops_its_generation() -> None:
    tokenizer = copy.deepcopy(load_model("builtin:tiny_moe_math").tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    server = scripted_server(tokenizer, "<tool_call>\n" + "x" * 2000, step_s=0.003)
    server.keepalive_s = 0.05
    try:
        host, port = server.httpd.server_address[:2]
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "stream": True}
        with socket.create_connection((host, port), timeout=10) as client:
            client.sendall(raw_request(server, "/v1/chat/completions", body))
            assert client.recv(4096).startswith(b"HTTP/1.1 200")  # the stream is under way
            time.sleep(0.2)
        assert wait_idle(server.engine) < 2.0  # not the 6 s of the whole script
        assert server.engine.aborted == 1
    finally:
        server.shutdown()


def test_a_template_without_tools_refuses_them(loaded_server_plain: EngineServer) -> None:
    user = [{"role": "user", "content": "hi"}]
    status, out = call(loaded_server_plain, "/v1/chat/completions", {"messages": user, "tools": [WEATHER]})
    assert status == 400 and "does not render tools" in out["error"]["message"]
    tool_turn = [*user, {"role": "tool", "content": "x"}]
    status, out = call(loaded_server_plain, "/v1/chat/completions", {"messages": tool_turn})
    assert status == 400 and "does not render tools" in out["error"]["message"]


@pytest.fixture(scope="module")
def loaded_server_plain() -> Iterator[EngineServer]:
    loaded = load_model("builtin:tiny_moe_math")
    engine = Engine(loaded.model, loaded.tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    server = EngineServer(engine, PromptFormatter(loaded.tokenizer, DataConfig()), "tiny", port=0)
    server.start()
    yield server
    server.shutdown()


THOUGHTS = [
    "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.",
    '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>\nStill thinking when the length cap came",
    "No thinking. </think> is just text here.",
    "  <thi",
    "Thought without the opening tag.</think>The answer.",
]


@pytest.mark.parametrize("thinking", [False, True])
def test_thinking_is_split_off_and_streams_in_pieces_that_add_up(thinking: bool) -> None:
    """`split_reasoning` and `ReasoningStream` (reasoning.py); `thinking`: the prompt opened the block."""
    assert split_reasoning(THOUGHTS[0]) == ("The user wants the weather.", "It is sunny.")
    assert split_reasoning(THOUGHTS[2]) == ("Still thinking when the length cap came", "")
    assert split_reasoning(THOUGHTS[3]) == (None, THOUGHTS[3])
    assert split_reasoning(THOUGHTS[5]) == (None, THOUGHTS[5])
    assert split_reasoning(THOUGHTS[5], thinking=True) == ("Thought without the opening tag.", "The answer.")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") and not prompt_opens_thinking("x")
    rng = random.Random(int(thinking))
    for text in THOUGHTS:
        for split in range(3):
            stream, thought, content = ReasoningStream(thinking), "", ""
            cuts = sorted(rng.sample(range(len(text) + 1), min(split * 4, len(text) + 1))) if split else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] if split else list(text)
            for piece in pieces:
                more, rest = stream.feed(piece)
                thought, content = thought + more, content + rest
                assert "</think" not in thought and (
                    "<think>" not in content or not text.lstrip().startswith("<")
                )
            more, rest = stream.finish()
            reasoning, want = split_reasoning(text, thinking)
            assert (thought + more, content + rest) == (reasoning or "", want), (text, pieces)


def test_a_reply_s_thinking_and_calls_stream_as_the_whole_message() -> None:
    """`reply_message` and `ReplyStream` (chat_reply.py), reasoning and tools together."""
    fmt = ReplyFormat(reasoning=True, tool_calls=True)
    for text in [*THOUGHTS, *REPLIES]:
        message, finish = reply_message(text, "stop", fmt)
        stream, got = ReplyStream(fmt), {"reasoning_content": "", "content": ""}
        calls, end = [], None
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)] or [""]
        for i, piece in enumerate(pieces):
            delta, end = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
            got["reasoning_content"] += delta.get("reasoning_content", "")
            got["content"] += delta.get("content", "")
            calls += delta.get("tool_calls", [])
        assert end == finish and (got["reasoning_content"] or None) == message["reasoning_content"]
        assert (got["content"] or None) == message["content"]
        assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]
    message, finish = reply_message(THOUGHTS[1], "stop", fmt)
    assert message["reasoning_content"] == "A tool." and message["content"] is None and finish == "tool_calls"
    assert reply_message(THOUGHTS[0], "stop", ReplyFormat()) == (
        {"role": "assistant", "content": THOUGHTS[0]},
        "stop",
    )


def test_the_server_splits_thinking_when_asked(monkeypatch: Any) -> None:
    loaded = load_model("builtin:tiny_moe_math")
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
    )
    engine = Engine(loaded.model, tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        EngineServer(engine, PromptFormatter(tokenizer, DataConfig()), "tiny", port=0, reasoning_parser="r2")
    server = EngineServer(
        engine, PromptFormatter(tokenizer, DataConfig()), "tiny", port=0, reasoning_parser="qwen3"
    )
    server.start()
    try:
        replying(monkeypatch, "The template opened the block.\n</think>\n\nSunny.")
        status, out = call(
            server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather?"}]}
        )
        assert status == 200, out
        message = out["choices"][0]["message"]
        assert (
            message["reasoning_content"] == "The template opened the block."
            and message["content"] == "Sunny."
        )
    finally:
        server.shutdown()
