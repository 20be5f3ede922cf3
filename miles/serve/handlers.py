"""The HTTP side of `miles serve`: one thread per connection (at most `max_connections`), routes to the
server's endpoints, bearer-key checks, request bodies read safely, JSON and server-sent-event responses."""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from miles.serve.schemas import ClientGone, RequestError

if TYPE_CHECKING:
    from miles.serve.app import EngineServer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (OpenAI bodies, tool schemas included, stay
far below it); deeper is a 400, where Python's parser would raise RecursionError (a 500) past ~1000 levels."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues while the accept loop catches up (the kernel caps it at net.core.somaxconn).
socketserver's default of 5 made a burst of 50 clients see resets and multi-second stalls."""
BUSY_LOG_EVERY_S = 60.0
"""Refusals past the connection cap are logged at most this often (a warning, with how many since)."""
CLIENT_IO_TIMEOUT_S = 60.0
"""A connection's socket reads and writes give up after this long: a client that sends a request slowly or
only in part (a Content-Length longer than its body), or stops reading a stream, would otherwise hold a server
thread (and a stream's generation) for ever. Idle keep-alive connections close after it too."""


class HTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: past it a connection gets a 503 and is
    closed at once (without the cap every connection, idle ones too, holds a thread until its timeout)."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self.request_queue_size = max(LISTEN_BACKLOG, max_connections)  # read by server_activate's listen()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refused, self._refusal_logged_at = 0, -BUSY_LOG_EVERY_S
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            refuse_busy(request, self.max_connections)
            self.shutdown_request(request)
            self._log_refusal()
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _log_refusal(self) -> None:
        """A 503 past the cap is logged, not silent, but at most once a BUSY_LOG_EVERY_S (a burst is one line)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= BUSY_LOG_EVERY_S:
            log.warning(
                "%d connection(s) refused with a 503: %d connections were open (miles serve --max-connections)",
                self._refused,
                self.max_connections,
            )
            self._refused, self._refusal_logged_at = 0, now


def refuse_busy(sock: socket.socket, limit: int) -> None:
    """A 503 on a connection past the cap, sent from the accepting thread (a few hundred bytes into a new
    socket's empty buffer: it does not block, and a client that never reads cannot hold the accept loop)."""
    busy = RequestError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"server busy: {limit} connections open (miles serve --max-connections); retry later",
        "server_busy",
    )
    data = strict_json(busy.payload())
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    )
    try:
        sock.settimeout(1.0)
        sock.sendall(head.encode() + data)
    except OSError:
        pass  # it left already


class HTTPServer6(HTTPServer):
    """The HTTP server on an IPv6 socket (`--host ::1`): socketserver's default family is IPv4 only."""

    address_family = socket.AF_INET6


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client at the other end of `sock` hung up: the socket reads as closed (EOF) or broken.
    Bytes waiting there (a pipelined request) are left unread and are no hang-up; nothing waits."""
    try:
        if hasattr(select, "poll"):  # poll has no FD_SETSIZE limit, which select's 1024 is
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            readable = bool(poller.poll(0))
        else:
            readable = bool(select.select([sock], [], [], 0)[0])
        return readable and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset by the peer, or already closed here
        return True


def handler_for(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    routes = {
        ("POST", "/v1/completions"): server.completions,
        ("POST", "/v1/chat/completions"): server.chat_completions,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _body_consumed = False
        """This request's body was read or discarded (reading it twice would block on the next request)."""

        @property
        def timeout(self) -> float:  # type: ignore[override]  # read by StreamRequestHandler.setup
            return server.client_io_timeout_s

        @property
        def route_path(self) -> str:
            """The path without its query string (`?api-version=...`), which no route reads."""
            return urllib.parse.urlsplit(self.path).path

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._body_consumed = False
            if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
                self._discard_body()  # else a body would be read as the next request on this connection
            path = self.route_path
            if path == "/health":  # liveness stays open; every other path, unknown ones too, needs the key
                if server.engine_alive:
                    self._send(HTTPStatus.OK, {"status": "ok"})
                else:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "engine thread stopped"})
            elif not self._authorized():
                return
            elif path in ("/v1/models", "/v1/models/"):
                self._send(HTTPStatus.OK, server.models())
            elif path.startswith("/v1/models/"):
                try:  # an id may hold slashes ("org/name") and escapes
                    self._send(HTTPStatus.OK, server.model(urllib.parse.unquote(path[len("/v1/models/") :])))
                except RequestError as err:
                    self._error(err)
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route GET {path}", "not_found"))

        def do_POST(self) -> None:  # noqa: N802
            self._body_consumed = False
            if not self._authorized():  # before the route: without the key, no answer says what exists
                return
            route = routes.get(("POST", self.route_path))
            if route is None:
                self._discard_body()
                self._error(
                    RequestError(HTTPStatus.NOT_FOUND, f"no route POST {self.route_path}", "not_found")
                )
                return
            try:
                result = route(self._body(), self._client_gone)
                if isinstance(result, dict):
                    self._send(HTTPStatus.OK, result)
                else:
                    self._send_events(result)
            except ClientGone:  # nobody to answer: its generation was aborted
                self.close_connection = True
                log.info("a client hung up before its response; its generation was aborted")
            except RequestError as err:
                self._error(err)
            except Exception as err:  # a bug: the request fails, the server stays up
                log.exception("request failed")
                self._error(
                    RequestError(
                        HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(err).__name__}: {err}", "server_error"
                    )
                )

        def _client_gone(self) -> bool:
            return peer_closed(self.connection)

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
            self._body_consumed = True
            if self.headers.get("Transfer-Encoding"):
                raise RequestError(
                    HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length (no chunked bodies)"
                )
            length = self._length()
            if length is None:
                raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must be a non-negative integer")
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            try:
                raw = self.rfile.read(length)
            except TimeoutError:  # what did arrive cannot be told from the next request: the connection ends
                self.close_connection = True
                raise RequestError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"the request's body did not arrive within {server.client_io_timeout_s:g} s",
                    "timeout",
                ) from None
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as err:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {err.msg}") from err
            except RecursionError:
                body = None  # nested deeper than the parser goes: refused just below
            if body is None or json_depth(body) > MAX_JSON_DEPTH:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST, f"body is nested more than {MAX_JSON_DEPTH} arrays / objects deep"
                )
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def _discard_body(self) -> None:
            if self._body_consumed:  # already read or dropped: a second read would wait for bytes never sent
                return
            self._body_consumed = True
            length = self._length()
            if length is not None and 0 < length <= MAX_BODY_BYTES:
                self.rfile.read(length)
            else:
                self.close_connection = True

        def _error(self, err: RequestError) -> None:
            self.close_connection = (
                True  # a refused request's body may be unread: do not reuse the connection
            )
            self._send(err.status, err.payload())

        def _send_events(self, events: Iterator[dict[str, Any] | None]) -> None:
            """Server-sent events, then `data: [DONE]`; the connection closes at the end (no length). A None
            is a keep-alive comment, which clients skip."""
            first = next(events)  # a RequestError before any event still becomes a plain error response
            self.close_connection = True
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in itertools.chain([first], events):
                    if event is None:
                        self.wfile.write(b": keep-alive\n\n")
                    else:
                        self.wfile.write(b"data: " + strict_json(event) + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass  # the client left (or its connection broke): closing the iterator cancels its generation
            finally:
                events.close()  # type: ignore[attr-defined]

        def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = strict_json(payload)
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


def json_depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (0 for a scalar); iterative, so a deep value
    cannot exhaust the stack that measures it."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # past the limit the answer is known: stop descending
            stack.extend((child, depth + 1) for child in children)
    return deepest


def strict_json(payload: dict[str, Any]) -> bytes:
    """Strict JSON: a NaN or infinity left in a payload (logprobs go through `json_logprob`) is a bug that
    fails the request (a 500) instead of sending what strict parsers (JavaScript, serde) reject."""
    return json.dumps(payload, allow_nan=False).encode()
