"""Tracker: a resumed run goes on logging to the interrupted run's W&B run (offline here, no key)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles.config import LoggingConfig
from miles.resume import read_run_state, write_run_state
from miles.tracking import Tracker


def test_a_resumed_tracker_logs_to_the_same_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggingConfig(wandb=True, wandb_mode="offline", progress=False, plot_every=0)
    first = Tracker(tmp_path / "first", cfg, {"a": 1}, "recipe", 4)
    first.log_step(1, {"reward/mean": 0.5})
    run_id = first.wandb_run_id
    first.close()
    assert run_id

    folder = tmp_path / "ckpt"
    folder.mkdir()
    trainer_state = {"tensors": {}, "meta": {}}
    config = {"trainer": {"max_steps": 4}, "recipe": "recipe"}
    write_run_state(folder, 1, config, trainer_state, {}, {}, wandb_run_id=run_id)
    assert json.loads((folder / "resume" / "run_state.json").read_text())["wandb_run_id"] == run_id
    state = read_run_state(folder)
    assert state.wandb_run_id == run_id

    second = Tracker(tmp_path / "second", cfg, {"a": 1}, "recipe", 4, wandb_run_id=state.wandb_run_id)
    second.log_step(2, {"reward/mean": 0.6})
    assert second.wandb_run_id == run_id
    second.close()
    assert list((tmp_path / "second" / "wandb").glob(f"offline-run-*-{run_id}"))


def test_the_wandb_run_goes_on_only_if_nothing_was_logged_past_the_checkpoint(tmp_path: Path) -> None:
    from miles.rl.checkpointing import continued_wandb_run

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    write_run_state(checkpoint, 2, {"trainer": {"max_steps": 4}}, {"tensors": {}, "meta": {}}, {}, {}, "abc")
    state = read_run_state(checkpoint)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    assert continued_wandb_run(checkpoint, state) == "abc"  # crashed during step 3
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    assert continued_wandb_run(checkpoint, state) is None  # W&B would drop the new step 3


def test_a_metrics_line_cut_short_by_a_crash_does_not_stop_the_resume(tmp_path: Path) -> None:
    """A crash mid-write leaves half a record at the end of metrics.jsonl: the resume reads the whole ones
    (as samples.jsonl's cut lines are dropped) and the rewritten file holds only whole records."""
    from miles.tracking import read_records

    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2))
    (run / "metrics.jsonl").write_text(whole + '{"step": 3, "reward/me')
    (run / "samples.jsonl").write_text(json.dumps({"step": 1}) + "\n" + '{"step": 3, "resp')
    assert [r["step"] for r in read_records(run)] == [1, 2]
    cfg = LoggingConfig(wandb=False, progress=False, plot_every=0)
    tracker = Tracker(run, cfg, {}, "recipe", 4)
    tracker.carry_over(run, 2)
    tracker.log_step(3, {"reward/mean": 0.7})
    tracker.close()
    assert [r["step"] for r in read_records(run)] == [1, 2, 3]
    assert all(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())


def test_a_new_run_never_mixes_its_records_into_another_runs(tmp_path: Path) -> None:
    from miles.errors import MilesUserError
    from miles.tracking import check_new_run_dir

    run = tmp_path / "run"
    check_new_run_dir(run)  # no folder yet
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    check_new_run_dir(run)  # a run that failed before its first record
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(MilesUserError, match="trainer.resume_from="):
        check_new_run_dir(run)
    with pytest.raises(MilesUserError, match="already holds"):
        check_new_run_dir(run, tmp_path / "other")  # resuming another run into this one's folder
    check_new_run_dir(run, run)  # resuming this run into its own folder: its records are cut back


SECRETS = (
    "s3cr3t-pass",
    "QUERYKEY123",
    "sk-bearer-abcdef",
    "hdr-api-key-42",
    "tok-nested-7",
    "envsecret-99887766",
)


def secret_config() -> dict:
    """A run config holding secrets the ways users pass them: a remote reward's URL with credentials and a
    `?key=`, its headers (`Authorization`, `X-Api-Key`), a list of dicts, camelCase and dashed names, and a
    value that is a secret environment variable's."""
    return {
        "reward": {
            "fn": "remote",
            "kwargs": {
                "url": "https://alice:s3cr3t-pass@judge.example.com:8443/score?key=QUERYKEY123&model=m1",
                "headers": {"Authorization": "Bearer sk-bearer-abcdef", "X-Api-Key": "hdr-api-key-42"},
                "endpoints": [{"url": "http://h/x", "accessToken": "tok-nested-7"}],
                "extra_payload": {"note": "pass envsecret-99887766 along"},
                "auth": {"user": "bob", "password": "s3cr3t-pass"},
            },
        },
        "data": {
            "prompt_key": "prompt",
            "label_key": "label",
            "path": "https://example.com/d.parquet?split=train",
        },
        "rollout": {"max_new_tokens": 32, "stop": ["</s>"]},
        "logging": {"wandb_project": "miles"},
    }


def test_redact_masks_secrets_at_any_depth_in_lists_urls_and_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.tracking import redact, redact_yaml

    monkeypatch.setenv("MY_SERVICE_TOKEN", "envsecret-99887766")
    config = secret_config()
    out = redact(config)
    text = json.dumps(out)
    assert not [s for s in SECRETS if s in text], text
    kwargs = out["reward"]["kwargs"]
    assert kwargs["url"] == "https://***@judge.example.com:8443/score?key=***&model=m1"
    assert kwargs["headers"] == {"Authorization": "***", "X-Api-Key": "***"}
    assert kwargs["endpoints"] == [{"url": "http://h/x", "accessToken": "***"}]
    assert kwargs["auth"] == {"user": "***", "password": "***"}
    # what is not a secret stays as it was, and the input is not changed
    assert out["data"] == config["data"] and out["rollout"] == config["rollout"]
    assert out["logging"] == config["logging"]
    assert config["reward"]["kwargs"]["headers"]["Authorization"] == "Bearer sk-bearer-abcdef"
    assert redact(out) == out  # masking twice changes nothing (a resumed run compares redacted configs)
    # the run folder's config.yaml
    from omegaconf import OmegaConf

    yaml = redact_yaml(OmegaConf.to_yaml(OmegaConf.create(config)))
    assert not [s for s in SECRETS if s in yaml], yaml
    assert "max_new_tokens: 32" in yaml and "prompt_key: prompt" in yaml


def test_redact_text_and_args_mask_bearer_tokens_url_credentials_and_secret_overrides() -> None:
    from miles.tracking import redact_args, redact_text

    assert (
        redact_text("GET https://u:p@h/x?access_token=abc&b=1 failed")
        == "GET https://***@h/x?access_token=***&b=1 failed"
    )
    assert redact_text("Authorization: Bearer eyJhbGciOi.JIUzI1N") == "Authorization: Bearer ***"
    assert redact_text("Token budget of 24 tokens; see https://docs.example.com/a?b=c") == (
        "Token budget of 24 tokens; see https://docs.example.com/a?b=c"
    )
    args = [
        "recipe=grpo_math",
        "+reward.kwargs.api_key=sk-live-1",
        "+reward.kwargs.headers={Authorization:'Bearer sk-live-2',X-Trace:t}",
        "+reward.kwargs.url=https://a:sk-live-3@h/s",
        "trainer.max_steps=3",
    ]
    out = " ".join(redact_args(args))
    assert "sk-live" not in out, out
    assert "recipe=grpo_math" in out and "trainer.max_steps=3" in out


def test_a_tracker_keeps_secrets_out_of_wandb_and_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """W&B gets the config redacted, and the command line it records too; a log record that quotes a URL
    with credentials (a remote reward's error) is masked on its way to the console and run.log."""
    import logging
    import sys

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MY_SERVICE_TOKEN", "envsecret-99887766")
    monkeypatch.setattr(
        sys, "argv", ["miles train", "+reward.kwargs.headers={Authorization:'Bearer sk-bearer-abcdef'}"]
    )
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        cfg = LoggingConfig(wandb=True, wandb_mode="offline", progress=False, plot_every=0)
        tracker = Tracker(tmp_path / "run", cfg, secret_config(), "recipe", 2)  # given unredacted
        tracker.log_step(1, {"reward/mean": 0.5})
        try:
            raise RuntimeError("https://alice:s3cr3t-pass@judge.example.com/score?key=QUERYKEY123 failed")
        except RuntimeError:
            logging.getLogger("miles.rewards").warning("reward failed", exc_info=True)
        logging.getLogger("miles.rewards").warning("header was Bearer %s", "sk-bearer-abcdef")
        tracker.close()
    finally:
        logging.getLogger().removeHandler(handler)
    err = capsys.readouterr().err
    assert "judge.example.com" in err and "reward failed" in err
    assert not [s for s in SECRETS if s in err], err
    assert sys.argv[1].endswith("'Bearer sk-bearer-abcdef'}")  # the process' own argv is left as it was
    leaked = [
        (path.name, s)
        for path in (tmp_path / "run").rglob("*")
        if path.is_file()
        for s in SECRETS
        if s.encode() in path.read_bytes()
    ]
    assert not leaked, leaked
    assert list((tmp_path / "run" / "wandb").rglob("*.wandb"))  # W&B did write its files


def test_env_values_that_look_like_credentials_are_masked_whatever_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The masking knew secrets by their variable's name (`*_TOKEN`, `*_API_KEY`): `JUDGE_KEY`, or a key in a
    variable named anything, went out in clear. Now a value that looks like a credential is masked whatever its
    variable is called, and so is any value of a `*_KEY` / `*_PASS` / `*_PWD` variable; ordinary values stay."""
    from miles.tracking import redact_text

    secrets = {
        "JUDGE_KEY": "hunter2hunter2",  # a `*_KEY` name: masked though the value looks ordinary
        "DB_PASS": "correct-horse-battery",
        "ANYTHING_AT_ALL": "Zx9vQ2mLp8RtY4wK",  # mixed case and digits: a credential whatever the name
        "HEXY": "9f86d081884c7d659a2feaa0c55ad015",  # a long hex token
    }
    ordinary = {
        "SOME_PATH": "/usr/local/lib/python3.11/site-packages",
        "MACHTYPE": "x86_64-pc-linux-gnu",
        "LANG": "en_US.UTF-8",
        "RUN_NAME": "grpo-math-experiment",
        "BIG_NUMBER": "12345678901234567890",
        "TERM": "xterm-256color",
        "PWD": "/work/some/folder",  # the shell's, not a `*_PWD` password
        "CERT_KEY": "/usr/local",  # a key file's path (it exists) is no secret
    }
    for name, value in {**secrets, **ordinary}.items():
        monkeypatch.setenv(name, value)
    text = " | ".join(f"value {v}" for v in {**secrets, **ordinary}.values())
    out = redact_text(text)
    assert not [v for v in secrets.values() if v in out], out
    assert all(v in out for v in ordinary.values()), out


def test_basic_authorization_and_url_userinfo_are_masked() -> None:
    from miles.tracking import redact_text

    cases = {
        "Authorization: Basic dXNlcjpwYXNzd29yZA==": "Authorization: Basic ***",
        "headers={'Authorization': 'Basic dXNlcjpwYXNz'}": "headers={'Authorization': 'Basic ***'}",
        "proxy-authorization=Token abc123def": "proxy-authorization=Token ***",
        '"authorization": "sk-live-raw-key-123"': '"authorization": "***"',
        "sent Basic YWxpY2U6czNjcjN0 upstream": "sent Basic *** upstream",
        "redis://:pa55word@cache:6379/0": "redis://***@cache:6379/0",
        "https://user:p@ss@host.example/x": "https://***@host.example/x",
        # what is no credential stays
        "basic arithmetic, then Basic Training": "basic arithmetic, then Basic Training",
        "authorization failed: check the key": "authorization failed: check the key",
        "mail me@example.com or see https://example.com/a@b": "mail me@example.com or see https://example.com/a@b",
    }
    for text, expected in cases.items():
        assert redact_text(text) == expected, text


def _sample(response: str, reward_info: dict) -> Any:
    from miles.sample import Sample

    return Sample(prompt="what is the key?", response_text=response, reward=0.0, reward_info=reward_info)


def test_samples_jsonl_and_uncaught_tracebacks_are_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A response or label that quotes a secret (the model saw it in a tool result, a reward's error quoted
    it) is masked in samples.jsonl; so is a traceback that reaches sys.excepthook (stderr, W&B's console)."""
    import sys
    import threading

    monkeypatch.setenv("JUDGE_KEY", "jk-9f8e7d6c5b4a3210")
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    cfg = LoggingConfig(wandb=False, progress=False, plot_every=0)
    tracker = Tracker(tmp_path / "run", cfg, {}, "recipe", 2)
    info = {"error": "judge said 401 for Authorization: Basic dXNlcjpwYXNzd29yZA=="}
    tracker.log_samples(1, [_sample("the key is jk-9f8e7d6c5b4a3210", info)])
    tracker.close()
    rows = (tmp_path / "run" / "samples.jsonl").read_text()
    assert "jk-9f8e7d6c5b4a3210" not in rows and "dXNlcjpwYXNzd29yZA" not in rows, rows
    assert "the key is ***" in rows
    try:
        raise RuntimeError("connecting with jk-9f8e7d6c5b4a3210 to https://bob:pw1234567@h/x")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    thread = threading.Thread(target=lambda: (_ for _ in ()).throw(ValueError("key jk-9f8e7d6c5b4a3210")))
    thread.start()
    thread.join()
    err = capsys.readouterr().err
    assert "RuntimeError" in err and "ValueError" in err and "https://***@h/x" in err, err
    assert "jk-9f8e7d6c5b4a3210" not in err and "pw1234567" not in err, err


class _FullDiskWandb:
    """A W&B run whose every write fails as on a full disk."""

    id = "full"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, *_: Any, **__: Any) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def finish(self) -> None:
        raise OSError(28, "No space left on device")


class _FlakyFile:
    """A file whose first `failures` writes fail with ENOSPC, writing nothing (then it has room again)."""

    def __init__(self, path: Path, failures: int) -> None:
        self.inner, self.failures = open(path, "ab", buffering=0), failures

    def write(self, data: bytes) -> int:
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        return self.inner.write(data)

    def close(self) -> None:
        self.inner.close()


def test_a_full_disk_loses_no_metrics_and_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """W&B failing on every step is one warning, not one a step nor silence; metrics.jsonl writes that fail
    are kept and written once there is room, so the file ends complete, each record once, in order."""
    import shutil

    cfg = LoggingConfig(wandb=False, progress=False, plot_every=0)
    tracker = Tracker(tmp_path / "run", cfg, {}, "recipe", 5)
    tracker.wandb_run = _FullDiskWandb()
    tracker.metrics.file = _FlakyFile(tmp_path / "run" / "metrics.jsonl", failures=2)
    free = shutil.disk_usage(tmp_path)._replace(free=10 << 20)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: free)
    with caplog.at_level("WARNING", logger="miles.tracking"):
        for step in range(1, 6):
            tracker.log_step(step, {"reward/mean": step / 10})
        tracker.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert tracker.wandb_run.calls == 5
    messages = [r.getMessage() for r in caplog.records]
    assert sum("W&B" in m and "No space left" in m for m in messages) == 1, messages
    assert sum("could not write to" in m and "metrics.jsonl" in m for m in messages) == 1, messages
    assert sum("MB free" in m for m in messages) == 1, messages
    assert any("W&B failed" in m and "5 steps" in m and "metrics.jsonl" in m for m in messages), messages
