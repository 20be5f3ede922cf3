"""`remote` against a real HTTP server on 127.0.0.1 (retries, timeouts, connection limit, error replies) with both
clients, and `judge` through a stand-in engine."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from miles.config import RewardConfig
from miles.rewards import JudgeReward, RewardRunner
from miles.rewards.judge import parse_judge_score
from miles.rewards.loading import load_target
from miles.sample import Sample

DATA = Path(__file__).parent / "data"
FAKE_ENGINE = f"{DATA / 'fake_judge.py'}:FakeJudgeEngine"


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), RewardHandler)
        self.lock = threading.Lock()
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(
            sys.exc_info()[1], BrokenPipeError | ConnectionResetError
        ):  # the client gave up: fine
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def reply(self, status: int, body: str) -> None:
        # The request stops counting as in flight before its answer goes out: once the client has the answer
        # it may open the next request, which must not find this one still counted.
        self.done()
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def done(self) -> None:
        with self.server.lock:
            if self.counted:
                self.counted = False
                self.server.in_flight -= 1

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        action, key = body["response"], str(body["label"])
        with self.server.lock:
            self.server.attempts[key] += 1
            attempt = self.server.attempts[key]
            self.server.bodies.append(body)
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
            self.counted = True
        try:
            if action == "ok":
                self.reply(200, json.dumps({"score": 1.0, "reason": "matched", "echo": body["metadata"]}))
            elif action == "number":
                self.reply(200, "0.25")
            elif action == "flaky":
                self.reply(503, "busy") if attempt <= 2 else self.reply(200, '{"score": 0.75}')
            elif action == "slow":
                time.sleep(0.3)
                self.reply(200, '{"score": 0.5}')
            elif action == "stuck":
                time.sleep(2.0)
                self.reply(200, '{"score": 1.0}')
            elif action == "bad":
                self.reply(400, '{"detail": "label missing"}')
            elif action == "notjson":
                self.reply(200, "<html>oops</html>")
            else:
                self.reply(500, "unknown action")
        finally:
            self.done()


@pytest.fixture
def server() -> Iterator[RewardServer]:
    srv = RewardServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def remote_cfg(server: RewardServer, client: str, **kwargs: object) -> RewardConfig:
    options = {"url": server.url, "client": client, "backoff_s": 0.05, "request_timeout_s": 0.5, **kwargs}
    return RewardConfig(fn="remote", kwargs=options, timeout_s=10, num_workers=2)


@pytest.mark.parametrize("client", ["httpx", "urllib"])
def test_remote_scores_retries_and_fails_cleanly(server: RewardServer, client: str) -> None:
    actions = ["ok", "number", "flaky", "bad", "notjson", "stuck"]
    batch = [
        Sample(prompt="q", response_text=a, label=f"{a}-{i}", metadata={"data_source": "ds", "k": i})
        for i, a in enumerate(actions)
    ]
    with RewardRunner(remote_cfg(server, client, max_retries=2)) as runner:
        metrics = runner.score(batch)
    ok, number, flaky, bad, notjson, stuck = batch
    assert ok.reward == 1.0 and ok.reward_info == {"reason": "matched", "echo": {"data_source": "ds", "k": 0}}
    assert number.reward == 0.25
    assert flaky.reward == 0.75 and server.attempts["flaky-2"] == 3  # two 503s, then success
    assert "HTTP 400" in bad.reward_info["error"] and server.attempts["bad-3"] == 1  # a 4xx is not retried
    assert "not JSON" in notjson.reward_info["error"]
    assert "failed after 3 attempts" in stuck.reward_info["error"] and server.attempts["stuck-5"] == 3
    assert metrics["reward/errors"] == 3.0 and metrics["reward/timeouts"] == 0.0
    assert server.bodies[0]["prompt"] == "q" and server.bodies[0]["data_source"] == "ds"


@pytest.mark.parametrize("client", ["httpx", "urllib"])
def test_remote_respects_the_connection_limit(server: RewardServer, client: str) -> None:
    batch = [Sample(response_text="slow", label=str(i)) for i in range(12)]
    # A generous request timeout: on a loaded machine a timed-out request is retried while the server still
    # serves it, which would count against the limit this test checks.
    with RewardRunner(remote_cfg(server, client, max_connections=3, request_timeout_s=10.0)) as runner:
        metrics = runner.score(batch)
    assert metrics["reward/mean"] == 0.5 and metrics["reward/errors"] == 0.0
    assert 2 <= server.max_in_flight <= 3


def test_remote_call_past_the_runner_timeout(server: RewardServer) -> None:
    cfg = remote_cfg(server, "httpx", request_timeout_s=5.0)
    cfg.timeout_s = 0.5
    batch = [Sample(response_text="stuck", label="x"), Sample(response_text="ok", label="y")]
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert batch[0].reward_info["error_kind"] == "timeout" and batch[1].reward == 1.0
    assert metrics["reward/timeouts"] == 1.0


@pytest.mark.parametrize("client", ["httpx", "urllib"])
def test_remote_retries_stop_within_total_timeout(server: RewardServer, client: str) -> None:
    """Retries that cannot fit in total_timeout_s are not started: the sample fails with the reward's own error
    before the runner's timeout, after as many attempts as fit."""
    cfg = remote_cfg(server, client, max_retries=10, request_timeout_s=0.4, total_timeout_s=1.0)
    cfg.timeout_s = 3.0
    batch = [Sample(response_text="stuck", label="budget")]
    start = time.monotonic()
    with RewardRunner(cfg) as runner:
        metrics = runner.score(batch)
    assert time.monotonic() - start < 2.5
    assert batch[0].reward_info["error_kind"] == "exception" and metrics["reward/timeouts"] == 0.0
    assert "(total_timeout_s=1 s spent)" in batch[0].reward_info["error"]
    assert 2 <= server.attempts["budget"] <= 3


def test_remote_defaults_fit_the_default_reward_timeout() -> None:
    from miles.rewards.remote import RemoteReward

    remote = RemoteReward("http://127.0.0.1:1/score")
    assert remote.total_timeout_s < RewardConfig().timeout_s
    with pytest.raises(ValueError, match="total_timeout_s > 0"):
        RemoteReward("http://127.0.0.1:1/score", total_timeout_s=0)


def test_remote_rejects_a_bad_url() -> None:
    with pytest.raises(Exception, match="http:// or https://"):
        RewardRunner(RewardConfig(fn="remote", kwargs={"url": "localhost:8000"}, num_workers=0))


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Score: 7", 7.0),
        ("score = 8.5 because", 8.5),
        ("**Score:** 6", 6.0),
        ("I'd give it 3/10", 3.0),
        ("4 out of 5", 8.0),
        ("9", 9.0),
        ("Score: 2\nScore: 5", 5.0),
        ("no idea", None),
        ("", None),
    ],
)
def test_parse_judge_score(text: str, score: float | None) -> None:
    assert parse_judge_score(text, 10.0) == score


def test_judge_with_the_policy_engine_in_process() -> None:
    engine = load_target(FAKE_ENGINE)()
    batch = [
        Sample(prompt=[{"role": "user", "content": "Capital of France?"}], response_text=r, label="Paris")
        for r in ("Paris", "London", "Lyon", "Berlin")
    ]
    with RewardRunner(
        RewardConfig(fn="judge", num_workers=2, kwargs={"max_new_tokens": 16}), engine=engine
    ) as r:
        metrics = r.score(batch)
    assert [s.reward for s in batch] == [0.9, 0.3, 1.0, 0.0]
    assert batch[3].reward_info["judge_parse_error"] is True
    assert batch[0].reward_info["judge_raw_score"] == 9.0
    assert len(engine.calls) == 1 and engine.calls[0][0] == 4  # one batched generate call
    params = engine.calls[0][1]
    assert params.temperature == 0.0 and params.n == 1 and params.max_new_tokens == 16
    assert metrics["reward/errors"] == 0.0


def test_judge_builds_a_second_engine_from_a_model_path() -> None:
    kwargs = {
        "model_path": "fake-judge",
        "engine_factory": f"{DATA / 'fake_judge.py'}:make_engine",
        "rubric": "Q: {prompt}\nRef: {label}\nResponse to grade:\n{response}\nScore 0-{max_score}.",
    }
    batch = [Sample(prompt="Capital?", response_text="paris", label="Paris")]
    with RewardRunner(RewardConfig(fn="judge", kwargs=kwargs, num_workers=0)) as runner:
        runner.score(batch)
    assert batch[0].reward == 0.9


def test_judge_config_errors() -> None:
    with pytest.raises(Exception, match="the judge needs an engine"):
        RewardRunner(RewardConfig(fn="judge", num_workers=0))
    with pytest.raises(ValueError, match="must contain"):
        JudgeReward(engine=load_target(FAKE_ENGINE)(), rubric="no slot for the response")


class CharTokenizer:
    """Printable ASCII, one token per character: enough for the engine to take text prompts."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [min(max(ord(c) - 32, 0), 95) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids)


def test_judge_through_the_real_engine() -> None:
    torch = pytest.importorskip("torch")
    from miles.config import RolloutConfig
    from miles.models import CausalLM, ModelArgs
    from miles.rollout import Engine

    args = ModelArgs(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    model = CausalLM(args)
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    engine = Engine(model.eval(), CharTokenizer(), RolloutConfig(kv_cache_bytes=16 << 20))
    rubric = "Ref: {label}\nAnswer: {response}\nScore 0-{max_score}:"
    batch = [Sample(prompt="2+2?", response_text=r, label="4") for r in ("4", "5", "four")]
    cfg = RewardConfig(fn="judge", num_workers=0, kwargs={"rubric": rubric, "max_new_tokens": 8})
    with RewardRunner(cfg, engine=engine) as runner:
        metrics = runner.score(batch)
    assert metrics["reward/errors"] == 0.0
    for sample in batch:  # a random model's reply: whatever it says, it is parsed or reported, never an error
        assert 0.0 <= sample.reward <= 1.0
        assert len(sample.reward_info["judge_reply"]) <= 8
        assert ("judge_raw_score" in sample.reward_info) != sample.reward_info.get("judge_parse_error", False)


def test_remote_requests_are_not_logged_one_line_each(
    server: RewardServer, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every request at INFO ("HTTP Request: POST ..."): with a batch of hundreds that flooded the
    console and run.log. The remote reward keeps it to DEBUG; its failures still reach the log."""
    batch = [Sample(prompt="q", response_text="ok", label=f"ok-{i}") for i in range(20)]
    with caplog.at_level("INFO"), RewardRunner(remote_cfg(server, "httpx")) as runner:
        runner.score(batch)
    assert [s.reward for s in batch] == [1.0] * 20
    per_request = [r for r in caplog.records if r.levelno >= 20 and "HTTP Request" in r.getMessage()]
    assert per_request == [], per_request[:2]
