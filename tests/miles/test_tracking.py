"""Tracker: a resumed run goes on logging to the interrupted run's W&B run (offline here, no key)."""

from __future__ import annotations

import json
from pathlib import Path

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
    from miles.loop import _continued_wandb_run

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    write_run_state(checkpoint, 2, {"trainer": {"max_steps": 4}}, {"tensors": {}, "meta": {}}, {}, {}, "abc")
    state = read_run_state(checkpoint)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    assert _continued_wandb_run(checkpoint, state) == "abc"  # crashed during step 3
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    assert _continued_wandb_run(checkpoint, state) is None  # W&B would drop the new step 3


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
