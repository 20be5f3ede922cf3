"""The OpenAI-compatible server over the engine (miles/serve/), on the builtin tiny model, over HTTP."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from miles.config import DataConfig, RolloutConfig
from miles.data import PromptFormatter
from miles.model_io import load_model
from miles.rollout import Engine, SamplingParams
from miles.rollout.outputs import hit_stop_string
from miles.rollout.request import Request
from miles.sample import Sample, SampleStatus
from miles.serve.app import EngineServer

MODEL = "builtin:tiny_moe_math"


@pytest.fixture(scope="module")
def loaded():  # noqa: ANN201
    return load_model(MODEL)


def start(loaded: Any, api_key: str | None = None, request_timeout_s: float = 3600.0) -> EngineServer:
    engine = Engine(loaded.model, loaded.tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    formatter = PromptFormatter(loaded.tokenizer, DataConfig())
    server = EngineServer(
        engine, formatter, "tiny", port=0, api_key=api_key, request_timeout_s=request_timeout_s
    )
    server.start()
    return server


@pytest.fixture(scope="module")
def server(loaded: Any) -> Iterator[EngineServer]:
    server = start(loaded)
    yield server
    server.shutdown()


def call(
    server: EngineServer, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(
        server.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_binds_localhost_and_lists_its_model(server: EngineServer) -> None:
    assert server.httpd.server_address[0] == "127.0.0.1"
    assert call(server, "/health") == (200, {"status": "ok"})
    status, body = call(server, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]


def test_completions_equal_the_engine_s_samples(server: EngineServer, loaded: Any) -> None:
    prompt = "Ann has 12 pens and gives away 7. How many pens are left?"
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.8,
        "n": 3,
        "seed": 5,
        "logprobs": 1,
        "return_token_ids": True,
    }
    status, out = call(server, "/v1/completions", body)
    assert status == 200, out
    ids = list(loaded.tokenizer(prompt)["input_ids"])
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=12, seed=5)
    expected = Engine(loaded.model, loaded.tokenizer, RolloutConfig()).generate([ids], params)
    assert [c["token_ids"] for c in out["choices"]] == [s.response_ids for s in expected]
    assert [c["text"] for c in out["choices"]] == [s.response_text for s in expected]
    assert [c["logprobs"]["token_logprobs"] for c in out["choices"]] == [s.rollout_logprobs for s in expected]
    assert all(c["prompt_token_ids"] == ids for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == sum(len(s.response_ids) for s in expected)
    assert {c["finish_reason"] for c in out["choices"]} <= {"stop", "length"}


def test_chat_completions_apply_the_chat_template(server: EngineServer, loaded: Any) -> None:
    messages = [{"role": "user", "content": "What is 12-7?"}]
    status, out = call(
        server,
        "/v1/chat/completions",
        {
            "messages": messages,
            "temperature": 0,
            "max_tokens": 10,
            "return_token_ids": True,
            "logprobs": True,
        },
    )
    assert status == 200, out
    (choice,) = out["choices"]
    ids = PromptFormatter(loaded.tokenizer, DataConfig()).ids(messages)
    assert choice["prompt_token_ids"] == ids and choice["message"]["role"] == "assistant"
    expected = Engine(loaded.model, loaded.tokenizer, RolloutConfig()).generate(
        [ids], SamplingParams(temperature=0.0, max_new_tokens=10)
    )[0]
    assert (
        choice["token_ids"] == expected.response_ids
        and choice["message"]["content"] == expected.response_text
    )
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == expected.rollout_logprobs


def test_alternatives_logprobs_are_the_engine_s_top_logprobs(server: EngineServer, loaded: Any) -> None:
    """Completions' `logprobs: N` and chat's `logprobs: true, top_logprobs: N` return, per token, the N most
    likely tokens and their logprobs under the distribution sampled from (`SamplingParams.top_logprobs`)."""
    prompt = "Ann has 12 pens and gives away 7. How many pens are left?"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 5, "logprobs": 3}
    status, out = call(server, "/v1/completions", body)
    assert status == 200, out
    ids = list(loaded.tokenizer(prompt)["input_ids"])
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8, seed=5, top_logprobs=3)
    (expected,) = Engine(loaded.model, loaded.tokenizer, RolloutConfig()).generate([ids], params)
    assert expected.top_logprobs is not None
    got = out["choices"][0]["logprobs"]["top_logprobs"]
    assert len(got) == len(expected.response_ids)
    for position, alternatives in zip(got, expected.top_logprobs):
        assert 1 <= len(position) <= 3
        assert list(position.values()) == pytest.approx([lp for _, lp in alternatives], abs=1e-5)
    # After the chat-template test, which compares exact logprobs: a chat prompt cached before it would
    # change its prefill's chunks.
    messages = [{"role": "user", "content": "What is 3+4?"}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    status, out = call(server, "/v1/chat/completions", body)
    assert status == 200, out
    chat_ids = PromptFormatter(loaded.tokenizer, DataConfig()).ids(messages)
    (greedy,) = Engine(loaded.model, loaded.tokenizer, RolloutConfig()).generate(
        [chat_ids], SamplingParams(temperature=0.0, max_new_tokens=6, top_logprobs=2)
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == EngineServer.token_strings(server, greedy.response_ids)
    for token, alts in zip(content, greedy.top_logprobs or [], strict=True):
        assert [a["logprob"] for a in token["top_logprobs"]] == pytest.approx(
            [lp for _, lp in alts], abs=1e-5
        )
    # Greedy: the chosen token is the most likely one, and its logprob is its alternative's.
    assert all(t["top_logprobs"][0]["token"] == t["token"] for t in content)
    assert all(t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-6) for t in content)


def test_concurrent_requests_share_engine_steps(server: EngineServer) -> None:
    results: list[tuple[int, Any]] = [None] * 8  # type: ignore[list-item]
    steps_before = server.engine.stats.steps

    def one(i: int) -> None:
        results[i] = call(
            server,
            "/v1/completions",
            {"prompt": [20 + i, 21, 22], "max_tokens": 20, "seed": i, "ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(status == 200 and len(body["choices"]) == 1 for status, body in results), results
    assert all(body["usage"]["completion_tokens"] == 20 for _, body in results)
    # Alone, 8 requests of 20 tokens take >= 160 steps; side by side a few more than 20.
    assert server.engine.stats.steps - steps_before < 100


def test_bad_requests_get_a_clear_error_and_the_server_stays_up(server: EngineServer) -> None:
    cases = [
        ("/v1/completions", b"{not json", 400, "not JSON"),
        ("/v1/completions", {"prompt": 3}, 400, "'prompt' must be"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "serves 'tiny'"),
        ("/v1/completions", {"prompt": "x", "stream": True, "logprobs": 1}, 400, "need stream=false"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
        ("/v1/completions", {"prompt": [5] * 5000}, 400, "context"),
        ("/v1/chat/completions", {"messages": []}, 400, "non-empty list"),
        ("/v1/embeddings", {"input": "x"}, 404, "no route"),
    ]
    for path, body, code, message in cases:
        status, out = call(server, path, body)
        assert status == code and message in out["error"]["message"], (path, body, status, out)
    assert call(server, "/v1/completions", {"prompt": "12+7=", "max_tokens": 2})[0] == 200
    assert not server.engine.has_unfinished and not server.engine._results


def test_an_api_key_is_required_when_set(loaded: Any) -> None:
    server = start(loaded, api_key="s3cret")
    try:
        assert call(server, "/v1/completions", {"prompt": "1", "max_tokens": 1})[0] == 401
        assert call(server, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        status, _ = call(
            server,
            "/v1/completions",
            {"prompt": "1", "max_tokens": 1},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert status == 200
        assert call(server, "/health")[0] == 200  # liveness stays open
    finally:
        server.shutdown()


def test_one_bad_request_does_not_fail_the_others(server: EngineServer) -> None:
    """A request that fails (here a stop list of numbers, refused before it reaches the engine) costs only
    itself, even while others run beside it."""
    results: dict[str, tuple[int, Any]] = {}

    def good() -> None:
        results["good"] = call(
            server, "/v1/completions", {"prompt": [30, 31], "max_tokens": 30, "ignore_eos": True}
        )

    thread = threading.Thread(target=good)
    thread.start()
    results["bad"] = call(server, "/v1/completions", {"prompt": [30, 31], "max_tokens": 5, "stop": [1]})
    thread.join()
    assert results["bad"][0] == 400 and "non-empty strings" in results["bad"][1]["error"]["message"]
    assert results["good"][0] == 200 and results["good"][1]["usage"]["completion_tokens"] == 30


def test_openai_fields_the_server_reads_and_those_it_refuses(server: EngineServer) -> None:
    ok = {"prompt": "12+7=", "max_tokens": 3, "max_completion_tokens": None, "logprobs": False}
    status, out = call(server, "/v1/completions", ok)
    assert status == 200 and out["choices"][0]["logprobs"] is None and out["usage"]["completion_tokens"] <= 3
    status, out = call(server, "/v1/completions", {"prompt": "12+7=", "max_tokens": None})
    assert status == 200 and out["usage"]["completion_tokens"] <= 16  # OpenAI's default
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+1?"}]},
    ]
    status, out = call(
        server, "/v1/chat/completions", {"messages": parts, "max_tokens": 4, "return_token_ids": True}
    )
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    status_plain, out_plain = call(
        server, "/v1/chat/completions", {"messages": plain, "max_tokens": 4, "return_token_ids": True}
    )
    assert status == status_plain == 200
    assert out["choices"][0]["prompt_token_ids"] == out_plain["choices"][0]["prompt_token_ids"]
    refused = [
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "'tools' are for /v1/chat/completions"),
        ({"prompt": "x", "logprobs": 21}, "'logprobs' must be"),
        ({"prompt": "x", "top_logprobs": 2}, "needs 'logprobs': true"),
        ({"prompt": "x", "logprobs": True, "top_logprobs": 25}, "'top_logprobs' must be"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for body, message in refused:
        status, out = call(server, "/v1/completions", body)
        assert status == 400 and message in out["error"]["message"], (body, out)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    status, out = call(server, "/v1/chat/completions", {"messages": image})
    assert status == 400 and "text content parts" in out["error"]["message"]


def test_broken_framing_is_refused_and_the_connection_closed(server: EngineServer) -> None:
    import http.client

    host, port = server.httpd.server_address[:2]
    for headers, code in (({"Content-Length": "-1"}, 400), ({"Transfer-Encoding": "chunked"}, 411)):
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.putrequest("POST", "/v1/completions")
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == code and response.getheader("Connection") == "close"
        connection.close()


def test_a_request_past_its_timeout_is_aborted(loaded: Any) -> None:
    server = start(loaded, request_timeout_s=0.3)
    try:
        status, out = call(
            server, "/v1/completions", {"prompt": [40, 41], "max_tokens": 900, "ignore_eos": True}
        )
        assert status == 504 and out["error"]["type"] == "timeout"
        for _ in range(200):  # the engine thread aborts it at its next look at the queue
            if not server.engine.has_unfinished:
                break
            threading.Event().wait(0.05)
        assert not server.engine.has_unfinished
        assert call(server, "/health") == (200, {"status": "ok"})
    finally:
        server.shutdown()


def test_the_bearer_scheme_is_case_insensitive(loaded: Any) -> None:
    server = start(loaded, api_key="k")
    try:
        status, _ = call(server, "/v1/models", headers={"Authorization": "bearer k"})
        assert status == 200
    finally:
        server.shutdown()


def stream(server: EngineServer, path: str, body: dict[str, Any]) -> list[Any]:
    """The events of a streamed request, `[DONE]` last."""
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = [line.decode().strip() for line in response]
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_streamed_text_is_the_whole_text(server: EngineServer) -> None:
    body = {
        "prompt": "Ann has 12 pens and gives away 7. How many pens are left?",
        "max_tokens": 20,
        "n": 2,
        "temperature": 0.9,
        "seed": 3,
    }
    _, whole = call(server, "/v1/completions", body)
    events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    chunks = [c for e in events[:-2] for c in e["choices"]]
    for choice in whole["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1]) and len(mine) > 2  # token by token


def test_streamed_chat_never_sends_what_a_stop_string_takes_back(server: EngineServer) -> None:
    messages = [{"role": "user", "content": "Ann has 12 pens and gives away 7. How many pens are left?"}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 30, "stop": ["####"]}
    _, whole = call(server, "/v1/chat/completions", body)
    events = stream(server, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[1:-1]]
    assert "".join(deltas) == whole["choices"][0]["message"]["content"] and not any("#" in d for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_string_with_a_special_token_cuts_the_streamed_text_as_the_whole(
    loaded: Any, path: str
) -> None:
    """The stop string "x<|im_end|>" matches where the text with special tokens kept has it: the reply ends
    before the "x", streamed or not, and no streamed piece ever held the "x" (nothing sent is taken back)."""
    server = scripted_server(loaded.tokenizer, "the sum of 5 and 7 is 12, x<|im_end|>more", step_s=0.002)
    try:
        if path == "/v1/completions":
            body: dict[str, Any] = {"prompt": "1+1=", "max_tokens": 40, "stop": ["x<|im_end|>"]}
        else:
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "stop": ["x<|im_end|>"],
            }
        status, whole = call(server, path, body)
        assert status == 200, whole
        (choice,) = whole["choices"]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert text == "the sum of 5 and 7 is 12, " and choice["finish_reason"] == "stop"
        events = stream(server, path, body)
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        pieces = [c["text"] if "text" in c else c["delta"].get("content") or "" for c in chunks]
        assert "".join(pieces) == text and not any("x" in piece for piece in pieces), pieces
        assert len([p for p in pieces if p]) > 2  # streamed as it was generated
        assert chunks[-1]["finish_reason"] == "stop"
    finally:
        server.shutdown()


def test_a_client_that_hangs_up_stops_its_generation(server: EngineServer) -> None:
    import socket

    host, port = server.httpd.server_address[:2]
    aborted = server.engine.stats.aborted
    body = json.dumps({"prompt": [50, 51], "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert client.recv(4096).startswith(b"HTTP/1.1 200")  # the stream is under way
    # Hung up: the server's next writes fail and it aborts the request instead of generating 1000 tokens.
    for _ in range(400):
        if not server.engine.has_unfinished:
            break
        threading.Event().wait(0.05)
    assert not server.engine.has_unfinished and server.engine.stats.aborted == aborted + 1


def test_streaming_a_refused_prompt_is_a_400_and_nulls_take_the_defaults(server: EngineServer) -> None:
    status, out = call(server, "/v1/completions", {"prompt": [5, 5000], "stream": True})
    assert status == 400 and "outside the model's vocabulary" in out["error"]["message"]
    status, out = call(
        server,
        "/v1/completions",
        {
            "prompt": "1+1=",
            "max_tokens": 2,
            "temperature": None,
            "top_p": None,
            "n": None,
            "top_k": None,
            "ignore_eos": None,
        },
    )
    assert status == 200 and len(out["choices"]) == 1


def test_a_get_s_body_is_not_read_as_a_request(server: EngineServer) -> None:
    import socket

    host, port = server.httpd.server_address[:2]
    smuggled = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    with socket.create_connection((host, port), timeout=10) as client:
        client.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled
        )
        client.settimeout(2)
        received = b""
        try:
            while chunk := client.recv(4096):
                received += chunk
        except TimeoutError:
            pass
    assert received.count(b"HTTP/1.1 ") == 1, received


def test_the_detokenizer_streams_a_stop_string_s_multibyte_characters_not_at_all() -> None:
    """A stop string of non-ASCII characters whose bytes span tokens: nothing of it is ever streamed, and the
    streamed pieces join into the whole text (byte-level tokenizer: SmolLM2's, converted from its GGUF)."""
    from miles.serve.tokens import Detokenizer

    class Bytes:  # one token per UTF-8 byte, as byte-level BPE splits rare characters
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    text, stop = "X答案Y", "答案"
    ids = list(text.encode())
    decoder, hold, pieces = Detokenizer(), len(stop) - 1, []
    for end in range(1, len(ids) - 1):  # the engine stops once the stop string is complete (before "Y")
        decoder.update(Bytes(), ids[:end])
        safe = decoder.text[: max(0, len(decoder.text) - hold)]
        pieces.append(safe[len(decoder.sent) :])
        decoder.sent = safe
    assert "".join(pieces) == "X" and not any("答" in p or "\ufffd" in p for p in pieces)


class ScriptedEngine:
    """An engine stand-in whose every request "generates" the tokens of `text`, one a step, `step_s` apart
    (logprob -0.5; with `top_logprobs`, the token itself and `alternative` at -inf), stopping on stop strings
    as the engine does (outputs.py): fast tests of what the server does around generation (hang-ups,
    held-back tool calls, token bytes, stop strings)."""

    def __init__(self, tokenizer: Any, text: str, step_s: float = 0.0, alternative: int = 0) -> None:
        self.tokenizer, self.step_s, self.alternative = tokenizer, step_s, alternative
        self.script = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        self.max_context, self.device = 100_000, None
        self.running: dict[int, tuple[list[int], SamplingParams, list[int], int]] = {}
        self.results: dict[int, Sample] = {}
        self.aborting: set[int] = set()
        self.aborted = 0
        self._next = 0

    def validate_prompt(self, ids: list[int]) -> str | None:
        return None

    def add_request(self, ids: list[int], params: SamplingParams, group_id: int = 0, index: int = 0) -> int:
        rid, self._next = self._next, self._next + 1
        self.running[rid] = (list(ids), params, [], index)
        return rid

    def abort(self, rid: int) -> None:
        if rid in self.running:
            self.aborting.add(rid)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> None:
        time.sleep(self.step_s)
        stop_texts: dict[int, str | None] = {}
        for rid, (prompt, params, out, index) in list(self.running.items()):
            if rid in self.aborting:
                status, self.aborted = SampleStatus.ABORTED, self.aborted + 1
            else:
                out.append(self.script[len(out)])
                done = len(out) == len(self.script) or len(out) >= params.max_new_tokens
                status = (
                    (SampleStatus.COMPLETED if len(out) == len(self.script) else SampleStatus.TRUNCATED)
                    if done
                    else None
                )
                req = Request(rid=rid, prompt_ids=prompt, params=params, seed=0, output_ids=out)
                if params.stop and hit_stop_string(req, self.tokenizer):
                    status, stop_texts[rid] = SampleStatus.COMPLETED, req.stop_text
            if status is None:
                continue
            del self.running[rid]
            text = stop_texts.get(rid)
            self.results[rid] = Sample(
                prompt_ids=prompt,
                response_ids=list(out),
                response_text=self.tokenizer.decode(out, skip_special_tokens=True) if text is None else text,
                rollout_logprobs=[-0.5] * len(out),
                status=status,
                index=index,
                top_logprobs=[[(t, -0.5), (self.alternative, float("-inf"))] for t in out]
                if params.top_logprobs
                else None,
            )

    def take_result(self, rid: int) -> Sample | None:
        return self.results.pop(rid, None)

    def partial_output(self, rid: int) -> list[int] | None:
        running = self.running.get(rid)
        return None if running is None else list(running[2])


def scripted_server(tokenizer: Any, text: str, **kwargs: Any) -> EngineServer:
    """A server over a `ScriptedEngine` (`step_s`, `alternative` go to it; the rest to the server)."""
    engine_kwargs = {k: kwargs.pop(k) for k in ("step_s", "alternative") if k in kwargs}
    engine = ScriptedEngine(tokenizer, text, **engine_kwargs)
    server = EngineServer(engine, PromptFormatter(tokenizer, DataConfig()), "tiny", port=0, **kwargs)
    server.start()
    return server


def raw_request(server: EngineServer, path: str, body: dict[str, Any] | bytes) -> bytes:
    """A POST sent over a bare socket, as its request bytes (for tests that hang up or need the raw reply)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )


def wait_idle(engine: Any, seconds: float = 20.0) -> float:
    """Seconds until `engine` has nothing running (at most `seconds`)."""
    start = time.monotonic()
    while engine.has_unfinished and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def strict_json(raw: bytes) -> Any:
    """JSON as strict parsers (JavaScript's, serde) read it: a bare NaN or Infinity fails."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"bare {constant} in the JSON")

    return json.loads(raw, parse_constant=refuse)


def byte_level_tokenizer() -> Any:
    """A tiny byte-level BPE tokenizer (as GPT-2's, Llama 3's, Qwen's): a rare character is one token a byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        ["hello world"],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<e>"]),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>")
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    return tokenizer


def test_stream_options_that_is_not_an_object_is_a_400_and_nothing_runs(server: EngineServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": True,
        "ignore_eos": True,
        "max_tokens": 500,
    }
    status, out = call(server, "/v1/chat/completions", body)
    assert status == 400 and "'stream_options' must be an object" in out["error"]["message"], out
    time.sleep(0.2)  # a job queued before the check would be running by now
    assert not server.engine.has_unfinished


def test_completions_logprobs_0_are_the_sampled_tokens_logprobs(server: EngineServer) -> None:
    status, out = call(server, "/v1/completions", {"prompt": "1+1=", "max_tokens": 3, "logprobs": 0})
    assert status == 200, out
    logprobs = out["choices"][0]["logprobs"]
    assert logprobs is not None and logprobs["top_logprobs"] is None
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == out["usage"]["completion_tokens"]
    status, out = call(server, "/v1/completions", {"prompt": "1+1=", "logprobs": 0, "stream": True})
    assert status == 400 and "need stream=false" in out["error"]["message"]  # asked for, not sent: refused


def test_the_no_op_values_of_unsupported_fields_are_accepted(server: EngineServer) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "text"}}),
        ("/v1/completions", {"prompt": "1", "max_tokens": 2, "suffix": ""}),
        ("/v1/completions", {"prompt": "1", "max_tokens": 2, "echo": False, "logit_bias": {}}),
    ]:
        status, out = call(server, path, body)
        assert status == 200, (body, out)
    for body, message in [
        ({"prompt": "1", "suffix": "end"}, "'suffix' is not supported"),
        ({"prompt": "1", "response_format": {"type": "json_schema"}}, 'only {"type": "text"}'),
    ]:
        status, out = call(server, "/v1/completions", body)
        assert status == 400 and message in out["error"]["message"], (body, out)


def test_logprobs_carry_each_token_s_own_bytes() -> None:
    """Byte-level tokens that each hold a piece of "é" (bytes C3 A9): `bytes` is each token's byte, not
    U+FFFD's; the text shows the byte, so the alternatives of completions (keyed by text) stay apart; and
    the -inf logprob of a dropped alternative is -9999.0 in strict JSON."""
    tokenizer = byte_level_tokenizer()
    pieces = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert len(pieces) == 2 and tokenizer.decode([pieces[0]]) == "\ufffd"  # the case this is about
    other = tokenizer("h", add_special_tokens=False)["input_ids"][0]
    server = scripted_server(tokenizer, "é", alternative=other)
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
        status, out = call(server, "/v1/chat/completions", chat)
        assert status == 200, out
        content = out["choices"][0]["logprobs"]["content"]
        assert [t["bytes"] for t in content] == [[0xC3], [0xA9]]
        assert [t["token"] for t in content] == ["\\xc3", "\\xa9"]
        assert bytes(b for t in content for b in t["bytes"]).decode() == "é"
        assert [a["logprob"] for a in content[0]["top_logprobs"]] == [-0.5, -9999.0]
        assert content[0]["top_logprobs"][1] == {"token": "h", "logprob": -9999.0, "bytes": [ord("h")]}
        assert EngineServer.token_strings(server, pieces) == ["\\xc3", "\\xa9"]
        with urllib.request.urlopen(
            urllib.request.Request(
                server.url + "/v1/completions",
                data=json.dumps({"prompt": "hi", "logprobs": 2}).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=30,
        ) as response:
            out = strict_json(response.read())
        top = out["choices"][0]["logprobs"]["top_logprobs"]
        assert top == [{"\\xc3": -0.5, "h": -9999.0}, {"\\xa9": -0.5, "h": -9999.0}]
    finally:
        server.shutdown()


def test_token_bytes_of_other_tokenizers(loaded: Any) -> None:
    """The GPT-2 alphabet is the tokenizers library's; a tokenizer that is not byte-level (the tiny model's:
    characters) takes each token decoded alone, and added (special) tokens are their text."""
    from tokenizers import pre_tokenizers

    from miles.serve.tokens import BYTE_LEVEL, TokenBytes

    assert (
        sorted(BYTE_LEVEL) == sorted(pre_tokenizers.ByteLevel.alphabet())
        and len(set(BYTE_LEVEL.values())) == 256
    )
    tokenizer = loaded.tokenizer
    ids = [
        *tokenizer("12 + 7", add_special_tokens=False)["input_ids"],
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert TokenBytes(tokenizer)(ids) == [tokenizer.decode([t]).encode() for t in ids]


def test_a_stop_string_of_multibyte_characters_is_found_one_byte_a_token() -> None:
    """The stop-string look-back counts tokens: one token a byte, a stop string of three 4-byte characters
    needs 12 tokens, more than its 3 characters + 8."""
    from miles.rollout.outputs import hit_stop_string
    from miles.rollout.request import Request

    class Bytes:  # one token per UTF-8 byte
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    for stop in ["答案", "最终答案", "🙂🙂🙂"]:
        req = Request(rid=0, prompt_ids=[1], params=SamplingParams(stop=[stop]), seed=0)
        for byte in f"x{stop}tail".encode():
            req.output_ids.append(byte)
            if hit_stop_string(req, Bytes()):
                break
        assert req.stop_text == "x" and len(req.output_ids) == 1 + len(stop.encode()), stop


def test_a_non_streamed_request_whose_client_hangs_up_is_aborted(loaded: Any) -> None:
    """An SDK that times out hangs up and retries: without watching the socket, every try would generate to
    its end for nobody."""
    import socket

    server = scripted_server(loaded.tokenizer, "7 " * 1000, step_s=0.003)
    server.client_poll_s = 0.05
    try:
        host, port = server.httpd.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as client:
            client.sendall(raw_request(server, "/v1/completions", {"prompt": "1", "max_tokens": 2000}))
            time.sleep(0.3)
        assert wait_idle(server.engine) < 2.0  # not the 6 s the whole script takes
        assert server.engine.aborted == 1
        assert call(server, "/health") == (200, {"status": "ok"})
    finally:
        server.shutdown()


def test_a_client_that_sends_its_request_in_part_is_timed_out(loaded: Any) -> None:
    """A body shorter than its Content-Length gets a 408 and an idle connection is closed, both after
    `client_io_timeout_s`, which frees their server threads; the server goes on answering others."""
    import socket

    server = scripted_server(loaded.tokenizer, "7 ")
    server.client_io_timeout_s = 0.3
    try:
        host, port = server.httpd.server_address[:2]
        partial = raw_request(server, "/v1/completions", {"prompt": "1", "max_tokens": 2})[:-5]
        # A body cut short; a connection that never sends anything.
        for request, answer in ((partial, b"HTTP/1.1 408"), (b"", b"")):
            with socket.create_connection((host, port), timeout=10) as client:
                client.sendall(request)
                start = time.monotonic()
                reply = b""
                while chunk := client.recv(4096):  # until the server closes the connection
                    reply += chunk
                assert reply.startswith(answer) and (answer or not reply), reply
                assert time.monotonic() - start < 5
        assert server.engine.aborted == 0 and not server.engine.has_unfinished  # nothing was queued
        assert call(server, "/health") == (200, {"status": "ok"})
    finally:
        server.shutdown()


def test_a_chat_template_that_refuses_the_messages_is_a_400(loaded: Any) -> None:
    import copy

    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = (
        "{%- if messages[-1].role != 'user' %}{{ raise_exception('No user query found in messages.') }}"
        "{% endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    )
    server = scripted_server(tokenizer, "ok")
    try:
        body = {"messages": [{"role": "system", "content": "x"}], "max_tokens": 2}
        status, out = call(server, "/v1/chat/completions", body)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", out
        assert "No user query found in messages." in out["error"]["message"]
    finally:
        server.shutdown()


def test_infinite_integers_are_a_400(server: EngineServer) -> None:
    for field_ in ("max_tokens", "n", "top_k", "seed"):
        for value in ("Infinity", "1e999"):
            raw = b'{"prompt": "1", "%s": %s}' % (field_.encode(), value.encode())
            status, out = call(server, "/v1/completions", raw)
            assert status == 400 and "bad sampling parameter" in out["error"]["message"], (field_, out)


def test_a_tiny_temperature_is_greedy_and_the_json_strict(server: EngineServer) -> None:
    """1e-45 > 0, but logits divided by it overflow to NaN: sampled as temperature 0, with finite logprobs."""

    def completion(temperature: float) -> Any:
        body = {"prompt": "1+1=", "max_tokens": 4, "temperature": temperature, "logprobs": 1}
        request = urllib.request.Request(
            server.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return strict_json(response.read())["choices"][0]

    greedy = completion(0.0)
    for temperature in (1e-45, 1e-30, 5e-324):
        assert completion(temperature) == greedy, temperature


def test_a_get_with_a_body_and_a_wrong_key_is_a_401(loaded: Any) -> None:
    import socket

    server = scripted_server(loaded.tokenizer, "ok", api_key="k")
    try:
        host, port = server.httpd.server_address[:2]
        for auth, code in ((b"Bearer k", b"200"), (b"Bearer wrong", b"401")):
            with socket.create_connection((host, port), timeout=5) as client:
                client.sendall(
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: "
                    + auth
                    + b"\r\nContent-Length: 2\r\n\r\n{}"
                )
                assert client.recv(100).startswith(b"HTTP/1.1 " + code)  # no answer: a timeout error
    finally:
        server.shutdown()


def test_the_request_timeout_is_checked_and_inf_is_none(loaded: Any) -> None:
    from miles.errors import MilesUserError
    from miles.serve.cli import main

    server = scripted_server(loaded.tokenizer, "12", request_timeout_s=float("inf"))
    try:
        assert server.request_timeout_s is None
        status, out = call(server, "/v1/completions", {"prompt": "1", "max_tokens": 2})
        assert status == 200, out
        events = stream(server, "/v1/completions", {"prompt": "1", "max_tokens": 2})
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == "12"
    finally:
        server.shutdown()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
            EngineServer(server.engine, server.formatter, "tiny", port=0, request_timeout_s=bad)
        with pytest.raises(MilesUserError, match="--request-timeout-s"):  # before the model loads
            main(["--model", "builtin:nope", "--request-timeout-s", str(bad)])


def test_an_ipv6_host_binds_an_ipv6_socket(loaded: Any) -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    server = scripted_server(loaded.tokenizer, "ok", host="::1")
    try:
        assert server.url.startswith("http://[::1]:")
        assert call(server, "/health") == (200, {"status": "ok"})
    finally:
        server.shutdown()


def test_query_strings_are_ignored_and_a_model_can_be_fetched(server: EngineServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert call(server, "/v1/chat/completions?api-version=2024-06-01", body)[0] == 200
    assert call(server, "/health?probe=1") == (200, {"status": "ok"})
    status, out = call(server, "/v1/models/tiny")
    assert status == 200 and out["id"] == "tiny" and out["object"] == "model"
    status, out = call(server, "/v1/models/gpt-4")
    assert status == 404 and out["error"]["type"] == "model_not_found"


def test_a_failed_bind_names_what_to_change() -> None:
    import errno
    import socket

    from miles.serve.cli import listen_hint

    assert "--port" in listen_hint(OSError(errno.EADDRINUSE, "Address already in use"))
    assert "--host" in listen_hint(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert "--host" in listen_hint(OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"))


def test_a_request_for_more_samples_than_the_cap_is_a_400_before_anything_runs(loaded: Any) -> None:
    """prompts × n past `max_samples_per_request` is refused before tokenizing or queueing; at the cap it
    runs."""
    server = scripted_server(loaded.tokenizer, "7 ", max_samples_per_request=4)
    try:
        for path, body in (
            ("/v1/completions", {"prompt": ["1", "2", "3"], "n": 2, "max_tokens": 1}),
            ("/v1/completions", {"prompt": "1", "n": 5, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "n": 5}),
        ):
            status, reply = call(server, path, body)
            assert status == 400 and "--max-samples-per-request" in reply["error"]["message"], reply
        assert server.engine.aborted == 0 and not server.engine.has_unfinished
        status, reply = call(server, "/v1/completions", {"prompt": ["1", "2"], "n": 2, "max_tokens": 1})
        assert status == 200 and len(reply["choices"]) == 4
        with pytest.raises(ValueError, match="max_samples_per_request"):
            EngineServer(server.engine, server.formatter, "tiny", port=0, max_samples_per_request=0)
    finally:
        server.shutdown()


def test_connections_past_the_cap_get_a_503_and_a_freed_slot_is_reused(loaded: Any) -> None:
    """With `max_connections` connections open (idle), the next gets a 503 at once and is closed; once one
    closes, new connections are served again."""
    import socket

    server = scripted_server(loaded.tokenizer, "7 ", max_connections=2)
    try:
        host, port = server.httpd.server_address[:2]
        held = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        time.sleep(0.3)  # both accepted, each holding a thread that waits for its request line
        with socket.create_connection((host, port), timeout=10) as extra:
            extra.sendall(raw_request(server, "/v1/completions", {"prompt": "1", "max_tokens": 1}))
            reply = b""
            while chunk := extra.recv(4096):  # the server closes it after the 503
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, reply
        assert "--max-connections" in json.loads(body)["error"]["message"]
        assert server.engine.aborted == 0 and not server.engine.has_unfinished  # nothing was queued
        held.pop().close()
        deadline = time.monotonic() + 10
        while (answer := call(server, "/health")) != (200, {"status": "ok"}) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the closed connection's thread has seen the hang-up
        assert answer == (200, {"status": "ok"})
        for sock in held:
            sock.close()
    finally:
        server.shutdown()
