"""Run tracking: metrics.jsonl, samples.jsonl, W&B (offline without an API key), plots, a progress bar.

Every write is append-and-flush, so a crash loses at most the step in flight; a resume into the run's own
folder rewrites the files whole, through a temporary file, so a crash leaves the old or the new version.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from miles.config import LoggingConfig
from miles.errors import MilesUserError
from miles.sample import Sample

log = logging.getLogger("miles.tracking")
_SECRET_ENDINGS = (
    "apikey",
    "token",
    "secret",
    "password",
    "passwd",
    "credential",
    "credentials",
    "authorization",
    "auth",
    "cookie",
    "privatekey",
    "accesskey",
    "secretkey",
)
"""Config keys whose values are masked: names ending so, compared in lower case without `_`, `-` or
spaces (`wandb_api_key`, `hf_token`, `X-Api-Key`, `Authorization`, `clientSecret`), not names that merely
contain the word (`max_new_tokens`, `prompt_key`)."""
_SECRET_QUERY_NAMES = ("key", "sig", "signature", "pwd")
"""URL query parameters masked besides those `_SECRET_ENDINGS` names (`?key=` is many APIs' key)."""
MASK = "***"
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_QUERY_PARAM = re.compile(r"([?&;])([^=&#\s;]+)=([^&#\s;]*)")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[a-z0-9._~+/=-]{8,}")
_MIN_ENV_SECRET = 8
"""Values of secret-named environment variables (`WANDB_API_KEY`) at least this long are masked wherever
they appear; shorter ones would mask ordinary text."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """A run folder's metrics.jsonl records, in order ([] when it has none). A line cut short by a crash
    (the process killed, the disk full) is left out, so the run can still be resumed."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d is not a whole JSON record (cut short by a crash?); skipped", path, number)
    return records


def check_new_run_dir(run_dir: Path, resumed_run: Path | None = None) -> None:
    """A run logs into a folder without records, or into that of the run it resumes (whose records past the
    checkpoint are cut back): appended after another run's, its steps would repeat theirs in metrics.jsonl,
    samples.jsonl and the plot."""
    if resumed_run is not None and resumed_run.resolve() == run_dir.resolve():
        return
    if read_records(run_dir):
        raise MilesUserError(
            f"{run_dir} already holds another run's metrics.jsonl, which this run's steps would be mixed into: "
            f"pick a new folder (hydra.run.dir=...), or go on with that run (trainer.resume_from={run_dir})"
        )


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        config_dict: dict[str, Any],
        recipe: str,
        total_steps: int,
        tokenizer: Any = None,
        wandb_run_id: str | None = None,
    ):
        """`wandb_run_id`: go on logging to that W&B run (a resumed run's), instead of starting one."""
        self.run_dir, self.cfg, self.total_steps, self.tokenizer = run_dir, cfg, total_steps, tokenizer
        (run_dir / "plots").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.samples_file = open(run_dir / "samples.jsonl", "a", buffering=1)
        self.history: list[dict[str, Any]] = []
        redact_logs()
        config_dict = redact(config_dict)
        self.wandb_run = self._init_wandb(config_dict, recipe, wandb_run_id) if cfg.wandb else None
        self.progress = None
        self._task = None
        if cfg.progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.progress.start()
            self._task = self.progress.add_task(recipe, total=total_steps, status="")

    @property
    def wandb_run_id(self) -> str | None:
        return None if self.wandb_run is None else str(self.wandb_run.id)

    def _init_wandb(self, config_dict: dict[str, Any], recipe: str, run_id: str | None) -> Any:
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed; set logging.wandb=false to silence this")
            return None
        mode = self.cfg.wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if os.environ.get("WANDB_MODE") == "disabled":
            mode = "disabled"
        argv = sys.argv
        sys.argv = [*argv[:1], *redact_args(argv[1:])]  # W&B records the command line (Hydra's overrides)
        try:
            return self._wandb_init(wandb, config_dict, recipe, run_id, mode)
        finally:
            sys.argv = argv

    def _wandb_init(
        self, wandb: Any, config_dict: dict[str, Any], recipe: str, run_id: str | None, mode: str
    ) -> Any:
        for attempt in [run_id, None] if run_id else [None]:
            try:
                return wandb.init(
                    project=self.cfg.wandb_project,
                    name=f"{recipe}-{self.run_dir.name}",
                    dir=str(self.run_dir),
                    config=config_dict,
                    mode=mode,
                    reinit="finish_previous",
                    id=attempt,
                    resume="allow" if attempt else None,
                )
            except Exception as e:  # tracking must never cost the run
                again = "; starting a new W&B run" if attempt else "; continuing without it"
                log.warning("W&B init failed (%s)%s", e, again)
        return None

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.history.append(record)
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=step)
            except Exception as e:
                log.warning("W&B log failed: %s", e)
        if self.progress is not None:
            reward = record.get("reward/mean")
            status = f"reward {reward:.3f}" if isinstance(reward, float) else ""
            if isinstance(record.get("eval/accuracy"), float):
                status += f" eval {record['eval/accuracy']:.3f}"
            if isinstance(record.get("time/step"), float):
                status += f" {record['time/step']:.1f}s/step"
            self.progress.update(self._task, completed=step, status=status)
        if self.cfg.plot_every and (step % self.cfg.plot_every == 0 or step == self.total_steps):
            self.plot()

    def carry_over(self, source_dir: Path, step: int) -> None:
        """A resumed run's earlier steps: the records of `source_dir` (the interrupted run's folder) up to
        `step` (its checkpoint's), into this run's metrics.jsonl and plot, not W&B (the interrupted run's W&B
        run, which this one goes on with, has them). Call it before this run logs anything.

        Resumed into its own folder, the files already hold those records and the ones past `step`, which
        this run will log again: metrics.jsonl and samples.jsonl are cut back to `step` instead."""
        records = [r for r in read_records(source_dir) if r.get("step", step + 1) <= step]
        self.history.extend(records)
        if source_dir.resolve() != self.run_dir.resolve():
            for record in records:
                self.metrics_file.write(json.dumps(record) + "\n")
            return
        self.metrics_file.close()
        _replace_text(self.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.samples_file.close()
        samples = self.run_dir / "samples.jsonl"
        _replace_text(samples, "".join(_rows_up_to(samples, step)))
        self.samples_file = open(samples, "a", buffering=1)

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        for sample in samples[: self.cfg.samples_per_step]:
            row = {
                "step": step,
                "prompt": sample.prompt,
                "response": sample.response_text,
                "reward": sample.reward,
                "label": sample.label,
                "status": sample.status.value,
                "response_length": sample.response_length,
            }
            if sample.reward_info:  # a reward's extra keys and errors (which may quote a URL with its key)
                row["reward_info"] = redact(sample.reward_info)
            if self.tokenizer is not None and sample.prompt_ids:
                row["prompt_text"] = self.tokenizer.decode(sample.prompt_ids)  # exactly what the model saw
            self.samples_file.write(json.dumps(row, default=str) + "\n")

    def plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        steps = [r["step"] for r in self.history if r.get("reward/mean") is not None]
        rewards = [r["reward/mean"] for r in self.history if r.get("reward/mean") is not None]
        evals = [(r["step"], r["eval/accuracy"]) for r in self.history if r.get("eval/accuracy") is not None]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if steps:
            ax.plot(steps, rewards, label="reward/mean")
        if evals:
            ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="eval/accuracy")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if steps or evals:
            ax.legend(loc="lower right")
        fig.tight_layout()
        tmp = self.run_dir / "plots" / ".reward.png.tmp"
        fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        os.replace(tmp, self.run_dir / "plots" / "reward.png")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.plot()
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as e:
                log.warning("W&B finish failed: %s", e)


def _rows_up_to(path: Path, step: int) -> list[str]:
    """The lines of a jsonl file whose row has a step <= `step` (a line cut short by a crash is dropped)."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", step + 1) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _replace_text(path: Path, text: str) -> None:
    """Write `path` whole through a temporary file, so that a crash leaves either version, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_secret_name(name: str) -> bool:
    """Whether a config key, header or environment variable name names a secret (see `_SECRET_ENDINGS`)."""
    compact = re.sub(r"[\s_-]", "", str(name)).lower()
    return compact.endswith(_SECRET_ENDINGS)


def redact_text(text: str) -> str:
    """`text` with what looks like a secret masked: the credentials of a URL (`https://user:pass@host`), the
    values of secret-named query parameters (`?key=`, `&access_token=`), bearer tokens, and the values of
    secret-named environment variables (`WANDB_API_KEY`, `HF_TOKEN`)."""
    if not text:
        return text
    for name, value in os.environ.items():
        if len(value) >= _MIN_ENV_SECRET and is_secret_name(name) and value in text:
            text = text.replace(value, MASK)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)

    def query(m: re.Match[str]) -> str:
        name = m.group(2)
        secret = is_secret_name(name) or name.lower().replace("-", "_") in _SECRET_QUERY_NAMES
        return f"{m.group(1)}{name}={MASK}" if secret and m.group(3) else m.group(0)

    text = _QUERY_PARAM.sub(query, text) if "=" in text else text
    return _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)


def redact(config: Any) -> Any:
    """Config copy with secret-looking values masked, for logs, W&B and the run's files: the values of
    secret-named keys (`redact_text`'s `is_secret_name`) at any depth, in dicts and lists, and secrets inside
    any other string (`redact_text`)."""
    if isinstance(config, dict):
        return {k: _mask_all(v) if is_secret_name(k) else redact(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return type(config)(redact(v) for v in config)
    if isinstance(config, str):
        return redact_text(config)
    return config


def _mask_all(value: Any) -> Any:
    """Every leaf of a secret-named key's dict or list (`auth: {user: u, password: p}`) masked."""
    if isinstance(value, dict):
        return {k: _mask_all(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_mask_all(v) for v in value)
    return MASK if value else value


def redact_args(args: list[str]) -> list[str]:
    """Command-line arguments with secrets masked: the value of a `key=value` override whose key, or a key
    inside whose dict value (`headers={Authorization: ...}`), names a secret, and `redact_text`'s finds."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        inner = re.findall(r"([A-Za-z0-9_.-]+)\s*:", value) if eq else []
        if eq and (is_secret_name(key.rsplit(".", 1)[-1]) or any(is_secret_name(k) for k in inner)):
            arg = f"{key}={MASK}"
        out.append(redact_text(arg))
    return out


def redact_yaml(text: str) -> str:
    """A resolved config's YAML with its secrets masked (`redact`), for the run folder's config.yaml."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    return OmegaConf.to_yaml(OmegaConf.create(redact(container)))


class RedactingFilter(logging.Filter):
    """Masks secrets (`redact_text`) in every record a handler writes, its traceback included: an error
    message that quotes a URL with credentials (a remote reward's) stays out of the console and run.log."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: the handler reports it as it would have
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = redact_text(text)
            if clean != text:
                record.exc_text = clean
        return True


def redact_logs() -> None:
    """Add `RedactingFilter` to the root logger's handlers (and logging's last-resort one), once each."""
    handlers = [*logging.getLogger().handlers, logging.lastResort]
    for handler in handlers:
        if handler is not None and not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
