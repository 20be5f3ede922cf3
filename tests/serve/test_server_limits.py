"""`miles serve` under hostile-but-fair load: a burst of connections, bodies nested past any sane depth, and
requests for routes that do not exist on a server that needs a key."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from miles.config import DataConfig, RolloutConfig
from miles.data import PromptFormatter
from miles.model_io import load_model
from miles.rollout import Engine
from miles.serve.app import EngineServer
from miles.serve.handlers import MAX_JSON_DEPTH

BURST = 300
"""Concurrent connections of the burst test: past the issue's 256 and past the default connection cap."""


@pytest.fixture(scope="module")
def loaded() -> Any:
    return load_model("builtin:tiny_moe_math")


def _start(loaded: Any, **kwargs: Any) -> EngineServer:
    engine = Engine(loaded.model, loaded.tokenizer, RolloutConfig(kv_cache_bytes=16 * 1024 * 1024))
    server = EngineServer(engine, PromptFormatter(loaded.tokenizer, DataConfig()), "tiny", port=0, **kwargs)
    server.start()
    return server


@pytest.fixture
def server(loaded: Any) -> Iterator[EngineServer]:
    server = _start(loaded, max_connections=BURST + 8)
    yield server
    server.shutdown()


def _exchange(server: EngineServer, request: bytes, timeout_s: float = 15.0) -> bytes:
    """The whole reply to one request on a fresh connection (the server closes it: `Connection: close`)."""
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def _post(path: str, raw: bytes, headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_a_burst_of_concurrent_connections_is_served_without_resets(server: EngineServer) -> None:
    """All BURST clients connect at the same moment (a listen backlog of 5 reset or stalled many of them)."""
    assert server.httpd.request_queue_size >= 256
    start = threading.Barrier(BURST)
    replies: list[bytes | BaseException] = [b""] * BURST

    def client(i: int) -> None:
        try:
            start.wait(timeout=30)
            replies[i] = _exchange(
                server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10
            )
        except BaseException as e:  # reported below with the others
            replies[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(BURST)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.1, 60 - (time.monotonic() - began)))
    failures = [r for r in replies if not isinstance(r, bytes) or not r.startswith(b"HTTP/1.1 200")]
    assert not failures, f"{len(failures)} of {BURST} failed, e.g. {failures[:3]}"
    assert time.monotonic() - began < 30


def test_a_body_nested_past_the_limit_is_a_400(server: EngineServer) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # Python's parser alone raises RecursionError on this
    nested = json.dumps(
        {"prompt": "1", "stop": json.loads("[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5))}
    )
    for raw in (deep, nested.encode()):
        reply = _exchange(server, _post("/v1/completions", raw))
        assert _status(reply) == 400, reply[:300]
        assert "nested" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert _status(_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200


def test_the_api_key_is_checked_before_the_route(loaded: Any) -> None:
    """Without the key, an unknown route is a 401 like a known one: nothing tells a scanner what exists."""
    server = _start(loaded, api_key="k3y-for-tests")
    try:
        get = "GET {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{}\r\n"
        for path in ("/v1/embeddings", "/admin", "/v1/models/x/y"):
            assert _status(_exchange(server, get.format(path, "").encode())) == 401, path
            assert _status(_exchange(server, _post(path, b"{}"))) == 401, path
        key = "Authorization: Bearer k3y-for-tests\r\n"
        assert _status(_exchange(server, get.format("/v1/embeddings", key).encode())) == 404
        assert _status(_exchange(server, _post("/v1/embeddings", b"{}", key))) == 404
        assert _status(_exchange(server, get.format("/health", "").encode())) == 200  # liveness stays open
    finally:
        server.shutdown()
