"""Run tracking: metrics.jsonl, samples.jsonl, W&B (offline without an API key), plots, a progress bar.

Every write is append-and-flush, so a crash loses at most the step in flight; a write a full disk refuses is
kept and written once there is room (line_appender.py). A resume into the run's own folder rewrites the files
whole, through a temporary file, so a crash leaves the old or the new version. W&B failing (a full disk, its
service gone) is logged once and costs the run nothing: metrics.jsonl stays the complete record. Secrets are
masked on the way into every file, log line and W&B (redaction.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from miles.config import LoggingConfig
from miles.errors import MilesUserError
from miles.line_appender import LineAppender
from miles.redaction import (  # noqa: F401  (re-exported: the masking's home was this module)
    MASK,
    RedactingFilter,
    is_secret_name,
    looks_like_credential,
    redact,
    redact_args,
    redact_logs,
    redact_text,
    redact_yaml,
)
from miles.sample import Sample

log = logging.getLogger("miles.tracking")
LOW_DISK_BYTES = 256 << 20
"""Below this much free space on the run folder's disk a warning says what may be lost: W&B's offline writer
fails silently on a full disk, checkpoints fail to save."""


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
        self.metrics = LineAppender(run_dir / "metrics.jsonl")
        self.samples = LineAppender(run_dir / "samples.jsonl")
        self.history: list[dict[str, Any]] = []
        self._wandb_failures = 0
        self._low_disk_warned = False
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
        self.metrics.write(json.dumps(record) + "\n")
        self.history.append(record)
        self._check_disk_space()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=step)
            except Exception as e:
                self._wandb_failed(step, e)
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

    def _wandb_failed(self, step: int, error: Exception, what: str = "log") -> None:
        """The first failure is a warning; the rest are counted and summed up at close (one line a step would
        bury the log of a run whose disk is full)."""
        self._wandb_failures += 1
        if self._wandb_failures == 1:
            log.warning(
                "W&B could not %s at step %d (%s); later W&B failures are counted, not logged. metrics.jsonl "
                "keeps every step's metrics",
                what,
                step,
                error,
            )

    def _check_disk_space(self) -> None:
        """Warns once when the run folder's disk is nearly full: W&B's offline history (written by its own
        process, which reports nothing) and checkpoints are the first to be lost."""
        if self._low_disk_warned:
            return
        try:
            free = shutil.disk_usage(self.run_dir).free
        except OSError:
            return
        if free < LOW_DISK_BYTES:
            self._low_disk_warned = True
            log.warning(
                "only %d MB free on the disk of %s: W&B's offline history (which fails silently), checkpoints and "
                "samples may not be written; metrics.jsonl keeps the metrics (and catches up once there is room)",
                free >> 20,
                self.run_dir,
            )

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
                self.metrics.write(json.dumps(record) + "\n")
            return
        self.metrics.close()
        _replace_text(self.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        self.metrics = LineAppender(self.run_dir / "metrics.jsonl")
        self.samples.close()
        samples = self.run_dir / "samples.jsonl"
        _replace_text(samples, "".join(_rows_up_to(samples, step)))
        self.samples = LineAppender(samples)

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        for sample in samples[: self.cfg.samples_per_step]:
            row = {
                "step": step,
                "group_id": sample.group_id,
                "index": sample.index,
                "weight_version": sample.weight_version,
                "prompt": sample.prompt,
                "response": sample.response_text,
                "reward": sample.reward,
                "label": sample.label,
                "status": sample.status.value,
                "response_length": sample.response_length,
            }
            if sample.reward_info:  # a reward's extra keys and errors (which may quote a URL with its key)
                row["reward_info"] = sample.reward_info
            if self.tokenizer is not None and sample.prompt_ids:
                row["prompt_text"] = self.tokenizer.decode(sample.prompt_ids)  # exactly what the model saw
            # Masked whole: a prompt, response or label may quote a secret as well as a reward's error may.
            self.samples.write(json.dumps(redact(row), default=str) + "\n")

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
        try:
            self.plot()
        except OSError as e:  # a full disk: the plot is the least of the run's records
            log.warning("could not write the reward plot: %s", e)
        self.metrics.close()
        self.samples.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as e:
                self._wandb_failed(len(self.history), e, "finish the run")
        if self._wandb_failures > 1:
            log.warning(
                "W&B failed %d times in this run (%d steps logged); its history may lack those steps, "
                "metrics.jsonl has them all",
                self._wandb_failures,
                len(self.history),
            )


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
