"""The `remote` built-in: POST each sample to the user's reward server.

Request body (JSON): {"prompt", "response", "label", "data_source", "metadata"} plus `extra_payload`. The server
answers a number or a JSON object with "score" (its other fields are logged). Each request has its own timeout;
connection errors, timeouts, 429 and 5xx are retried with exponential backoff; other 4xx fail at once with the
server's message. All attempts for one sample share `total_timeout_s` (default 9 s, below the default
reward.timeout_s of 10 s): an attempt gets at most what is left of it and no retry starts once it is spent, so the
defaults (5 s per request, 3 retries) end with this reward's own error, not the runner's timeout. Keep
total_timeout_s below reward.timeout_s when changing either. At most `max_connections` requests are open at a
time. Uses httpx's async client when httpx is installed, otherwise urllib in threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from miles.sample import Sample

RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class _RequestLinesAtDebug(logging.Filter):
    """httpx logs every request at INFO ("HTTP Request: POST URL ..."): one line per sample floods the console
    and run.log. They become DEBUG lines, shown only where the `httpx` logger is set to DEBUG; failures still
    reach the log through the reward runner (once per kind) and reward/errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not str(record.msg).startswith("HTTP Request:"):
            return True
        if logging.getLogger("httpx").getEffectiveLevel() > logging.DEBUG:
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _quiet_request_lines() -> None:
    logger = logging.getLogger("httpx")
    if not any(isinstance(f, _RequestLinesAtDebug) for f in logger.filters):
        logger.addFilter(_RequestLinesAtDebug())


class RemoteRewardError(RuntimeError):
    """The server answered with an error that retrying will not fix, or retries ran out."""


def _has_httpx() -> bool:
    try:
        import httpx  # noqa: F401
    except ImportError:
        return False
    return True


def _body(sample: Sample, extra_payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": sample.prompt,
        "response": sample.response_text,
        "label": sample.label,
        "data_source": sample.data_source,
        "metadata": sample.metadata,
        **extra_payload,
    }


def _parse_reply(status: int, text: str, url: str) -> Any:
    if status >= 400:
        raise RemoteRewardError(f"{url} answered HTTP {status}: {text[:300]}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RemoteRewardError(f"{url} answered something that is not JSON: {text[:200]!r}") from e


class RemoteReward:
    def __init__(
        self,
        url: str,
        request_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 32,
        headers: dict[str, str] | None = None,
        extra_payload: dict[str, Any] | None = None,
        client: str = "auto",
        total_timeout_s: float = 9.0,
    ) -> None:
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        if client not in ("auto", "httpx", "urllib"):
            raise ValueError(f"client must be auto | httpx | urllib, got {client!r}")
        if max_connections < 1 or max_retries < 0 or request_timeout_s <= 0 or total_timeout_s <= 0:
            raise ValueError(
                "need max_connections >= 1, max_retries >= 0, request_timeout_s > 0 and total_timeout_s > 0"
            )
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.extra_payload = dict(extra_payload or {})
        self.use_httpx = client == "httpx" or (client == "auto" and _has_httpx())
        if self.use_httpx:
            _quiet_request_lines()
        self._client: Any = None
        self._gate: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind_to_loop(self) -> None:
        """Clients and semaphores belong to one event loop; the runner may replace its loop after a hang."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        self._gate = asyncio.Semaphore(self.max_connections)
        if self.use_httpx:
            import httpx

            self._client = httpx.AsyncClient(
                limits=httpx.Limits(
                    max_connections=self.max_connections, max_keepalive_connections=self.max_connections
                ),
                timeout=httpx.Timeout(self.request_timeout_s, pool=None),
            )

    async def _post_once(self, payload: bytes, timeout_s: float) -> tuple[int, str]:
        if self.use_httpx:
            import httpx

            reply = await self._client.post(
                self.url, content=payload, headers=self.headers, timeout=httpx.Timeout(timeout_s, pool=None)
            )
            return reply.status_code, reply.text
        return await asyncio.to_thread(self._post_urllib, payload, timeout_s)

    def _post_urllib(self, payload: bytes, timeout_s: float) -> tuple[int, str]:
        request = urllib.request.Request(self.url, data=payload, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return reply.status, reply.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def _is_transport_error(self, error: BaseException) -> bool:
        if self.use_httpx:
            import httpx

            return isinstance(error, httpx.TransportError)
        return isinstance(error, urllib.error.URLError | TimeoutError | ConnectionError | OSError)

    async def __call__(self, sample: Sample) -> Any:
        self._bind_to_loop()
        payload = json.dumps(_body(sample, self.extra_payload), default=str).encode()
        last_problem = ""
        deadline = time.monotonic() + self.total_timeout_s
        attempts = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                backoff = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + backoff >= deadline:
                    break  # no time left for another attempt within total_timeout_s
                await asyncio.sleep(backoff)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                async with self._gate:
                    status, text = await self._post_once(payload, min(self.request_timeout_s, remaining))
            except Exception as e:
                if not self._is_transport_error(e):
                    raise
                last_problem = f"{type(e).__name__}: {e}"
                continue
            if status in RETRY_STATUS:
                last_problem = f"HTTP {status}: {text[:200]}"
                continue
            return _parse_reply(status, text, self.url)
        spent = (
            "" if attempts == self.max_retries + 1 else f" (total_timeout_s={self.total_timeout_s:g} s spent)"
        )
        raise RemoteRewardError(f"{self.url} failed after {attempts} attempts{spent}; last: {last_problem}")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
