"""Prompt data: the built-in synthetic math set, local jsonl / parquet / saved datasets (including verl's
math parquet schema), and reasoning-gym tasks; prompt templating and tokenisation into `Sample`s."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles import synthetic_math
from miles.config import DataConfig
from miles.data_files import Records, json_type, load_saved_dataset, read_json, read_jsonl, read_parquet
from miles.errors import MilesUserError
from miles.sample import Sample

log = logging.getLogger("miles.data")


@dataclass
class PromptRow:
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)


def _synthetic_rows(cfg: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    if cfg.difficulty not in ("easy", "medium"):
        raise MilesUserError(f"data.difficulty={cfg.difficulty!r}: the synthetic math set is easy or medium")
    train, test = synthetic_math.splits(cfg.train_size, cfg.test_size, cfg.seed, cfg.difficulty)
    noise_rng = random.Random(cfg.seed + 7919)

    def rows(problems: list[synthetic_math.MathProblem]) -> list[PromptRow]:
        out = []
        for p in problems:
            solution = p.mistaken_solution if noise_rng.random() < cfg.sft_noise else p.solution
            out.append(
                PromptRow(p.question, str(p.answer), {"data_source": "synthetic_math", "solution": solution})
            )
        return out

    return rows(train), rows(test)


_MISSING = object()


def _get_path(row: dict[str, Any], dotted: str, missing: Any = None) -> Any:
    """The value under a dotted key (`reward_model.ground_truth`), or `missing` where the row has no such key."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return missing
        value = value[part]
    return value


def _has_path(row: dict[str, Any], dotted: str) -> bool:
    """Whether `row` has the (dotted) key, null or not: only a key missing from every row is a
    misconfiguration."""
    return _get_path(row, dotted, _MISSING) is not _MISSING


def _key_paths(records: list[dict[str, Any]]) -> list[str]:
    """Every key of the records, nested dicts' under their dotted names (as data.label_key takes them)."""
    paths: set[str] = set()

    def walk(value: dict[str, Any], prefix: str) -> None:
        for key, inner in value.items():
            paths.add(prefix + str(key))
            if isinstance(inner, dict):
                walk(inner, f"{prefix}{key}.")

    for record in records:
        walk(record, "")
    return sorted(paths)


_LABEL_FALLBACKS = ("reward_model.ground_truth", "answer")
"""Read, in order, where a row has no label under data.label_key (verl's schema, then a plain answer)."""


def check_label_key(records: list[dict[str, Any]], cfg: DataConfig, where: str) -> None:
    """Stop when data.label_key names a key no record has: a typo would otherwise leave every label None (or
    silently read a fallback column), and the run would train against nothing. The default key may be absent:
    then the fallbacks are read, and data without labels is fine for rewards that need none (a warning
    says so)."""
    if not records or any(_has_path(r, cfg.label_key) for r in records):
        return
    keys = _key_paths(records)
    if cfg.label_key != DataConfig.label_key:
        raise MilesUserError(
            f"data.label_key={cfg.label_key!r}: no row of {where} has that key; the rows have {keys}. Set "
            "data.label_key to the column holding the ground truth (a dotted path for a nested one, e.g. "
            "reward_model.ground_truth)"
        )
    if not any(_has_path(r, key) for r in records for key in _LABEL_FALLBACKS):
        log.warning(
            "no row of %s has a label (%s, nor %s); the rows have %s. Rewards that compare with a label will "
            "score 0: set data.label_key to the column holding the ground truth",
            where,
            cfg.label_key,
            " / ".join(_LABEL_FALLBACKS),
            keys,
        )


def rows_from_records(records: Records, cfg: DataConfig, where: str) -> list[PromptRow]:
    """`row_from_record` of each record, after `check_label_key` over all of them (`where` names the data in
    that error; each row's own errors name its file and line or row)."""
    check_label_key(records.rows, cfg, where)
    return [row_from_record(r, cfg, records.where(i)) for i, r in enumerate(records.rows)]


_PROMPT_FORMS = (
    'a prompt is text or a list of chat messages like {"role": "user", "content": "..."}; fix or drop the '
    "row, or set data.prompt_key to the column that holds the prompt"
)


def check_prompt(prompt: Any, key: str, where: str) -> None:
    """A prompt the formatter can use: non-blank text, or a non-empty list of {role, content} messages."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MilesUserError(f"{where}: {key!r} is empty; {_PROMPT_FORMS}")
        return
    if not isinstance(prompt, list):
        kind = "null" if prompt is None else f"a {json_type(prompt)}"
        raise MilesUserError(f"{where}: {key!r} is {kind}; {_PROMPT_FORMS}")
    if not prompt:
        raise MilesUserError(f"{where}: {key!r} is an empty list of messages; {_PROMPT_FORMS}")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            problem = f"a JSON {json_type(message)}, not a message object"
        elif not isinstance(message.get("role"), str):
            problem = "a message without a 'role' (text)"
        elif "content" not in message:
            problem = "a message without 'content'"
        else:
            continue
        raise MilesUserError(f"{where}: {key!r}[{j}] is {problem}; {_PROMPT_FORMS}")


def row_from_record(record: dict[str, Any], cfg: DataConfig, where: str = "a data row") -> PromptRow:
    """One dataset record -> PromptRow. verl's schema: `prompt` (chat messages), `reward_model.ground_truth`,
    `data_source`, `extra_info`. `where` (`FILE:LINE`, `FILE row N`) is named in its errors."""
    if cfg.prompt_key not in record:
        raise MilesUserError(
            f"{where} has no {cfg.prompt_key!r} column (it has {sorted(record)}); set data.prompt_key to the "
            "column that holds the prompt, or fix the row"
        )
    prompt = record[cfg.prompt_key]
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    check_prompt(prompt, cfg.prompt_key, where)
    if isinstance(prompt, list):
        prompt = [dict(m) for m in prompt]
    label = _get_path(record, cfg.label_key)
    for fallback in _LABEL_FALLBACKS:
        if label is None:
            label = _get_path(record, fallback)
    metadata = {k: v for k, v in record.items() if k not in (cfg.prompt_key,)}
    metadata.setdefault("data_source", record.get("data_source") or "file")
    return PromptRow(prompt, label, metadata)


TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("test", "validation")
"""Splits of a saved DatasetDict read by default, in order of preference (`DIR:split` picks one explicitly)."""


def split_path(path: str) -> tuple[str, str | None]:
    """`DIR:split` -> (DIR, split) for a saved dataset folder; any other path -> (path, None)."""
    if Path(path).exists() or ":" not in path:
        return path, None
    base, split = path.rsplit(":", 1)
    return (base, split) if split and Path(base).is_dir() else (path, None)


def _pick_split(ds: Any, path: str, split: str | None, preferred: tuple[str, ...], role: str) -> Any:
    """The split of DatasetDict `ds` that `role` reads: the explicit one, else the first of `preferred` it has."""
    splits = sorted(ds)
    if split is not None:
        if split not in ds:
            raise MilesUserError(f"{role}={path}:{split}: no split {split!r}; the dataset has {splits}")
        chosen = split
    else:
        chosen = next((name for name in preferred if name in ds), next(iter(ds)))
        if chosen not in preferred:  # e.g. an eval path whose dict has only "train": say so, loudly
            log.warning(
                "%s=%s has no %s split; reading split %r of %s. Pass %s:<split> to choose one",
                role,
                path,
                " / ".join(repr(name) for name in preferred),
                chosen,
                splits,
                path,
            )
    log.info("%s=%s: reading split %r (the dataset has %s)", role, path, chosen, splits)
    return ds[chosen]


def _load_records(path: str, preferred: tuple[str, ...] = TRAIN_SPLITS, role: str = "data.path") -> Records:
    """Records of a jsonl / json / parquet file or a saved dataset folder (data_files.py: errors name the file
    and line). For a saved DatasetDict, `DIR:split` reads that split; a bare DIR reads the first of `preferred`
    it has (train for training, test then validation for evaluation)."""
    import datasets

    path, split = split_path(path)
    p = Path(path)
    if not p.exists():
        raise MilesUserError(
            f"data file {path} does not exist; pass data.path=<jsonl | parquet | saved dataset[:split]>"
        )
    if p.is_dir():
        ds = load_saved_dataset(p)
        if isinstance(ds, datasets.DatasetDict):
            ds = _pick_split(ds, path, split, preferred, role)
        elif split is not None:
            raise MilesUserError(
                f"{role}={path}:{split}: {path} is a single saved dataset with no splits; drop ':{split}'"
            )
        rows = list(ds)
        if not rows:
            raise MilesUserError(
                f"{role}={path}: the dataset has no rows; a data set needs rows with a prompt"
            )
        return Records(rows, path)
    if p.suffix == ".jsonl":
        return read_jsonl(p, path)
    if p.suffix == ".json":
        return read_json(p, path)
    if p.suffix == ".parquet":
        return read_parquet(p, path)
    raise MilesUserError(f"cannot read {path}: use .jsonl, .json, .parquet or a datasets.save_to_disk folder")


def _reasoning_gym_rows(task: str, cfg: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise MilesUserError("data.source=reasoning_gym:<task> needs `pip install 'miles[reasoning]'`") from e
    try:
        # reasoning-gym refuses size 0: `miles eval` asks for the held-out split alone
        settings = dict(cfg.task_config)
        train = (
            reasoning_gym.create_dataset(task, size=cfg.train_size, seed=cfg.seed, **settings)
            if cfg.train_size
            else []
        )
        test = reasoning_gym.create_dataset(task, size=cfg.test_size, seed=cfg.seed + 10_000, **settings)
    except Exception as e:  # reasoning-gym raises plain errors for unknown task names and settings
        raise MilesUserError(
            f"reasoning-gym cannot create task {task!r} with data.task_config={dict(cfg.task_config)}: {e!r}"
        ) from e

    def rows(ds: Any) -> list[PromptRow]:
        return [
            PromptRow(
                entry["question"],
                str(entry["answer"]),
                {"data_source": f"reasoning_gym:{task}", "rg_metadata": entry.get("metadata", {})},
            )
            for entry in ds
        ]

    return rows(train), rows(test)


def load_rows(cfg: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, held-out rows) for the configured source; data.eval_path, when set, gives the held-out
    rows whatever the source (e.g. training on synthetic math, evaluating on a file of real problems)."""
    source = "file" if cfg.path else cfg.source
    if source == "synthetic_math":
        train, test = _synthetic_rows(cfg)
    elif source.startswith("reasoning_gym:"):
        train, test = _reasoning_gym_rows(source.split(":", 1)[1], cfg)
    elif source == "file":
        if not cfg.path:
            raise MilesUserError("data.source=file needs data.path=<jsonl | parquet | saved dataset folder>")
        train, test = rows_from_records(_load_records(cfg.path), cfg, f"data.path={cfg.path}"), []
    else:
        raise MilesUserError(
            f"unknown data.source {source!r}; use synthetic_math, file (with data.path) or reasoning_gym:<task>"
        )
    return train, (load_eval_file_rows(cfg) if cfg.eval_path else test)


def load_eval_file_rows(cfg: DataConfig) -> list[PromptRow]:
    """The held-out rows of data.eval_path (a saved DatasetDict: its test split, else validation; `DIR:split`
    picks one); [] without an eval path."""
    if not cfg.eval_path:
        return []
    records = _load_records(cfg.eval_path, EVAL_SPLITS, "data.eval_path")
    return rows_from_records(records, cfg, f"data.eval_path={cfg.eval_path}")


def load_eval_rows(cfg: DataConfig) -> list[PromptRow]:
    """Only the held-out rows (`miles eval`): data.eval_path's when set, without reading the training data."""
    if cfg.eval_path:
        return load_eval_file_rows(cfg)
    return load_rows(cfg)[1]


def fewshot_turns(examples: list[dict[str, str]]) -> list[dict[str, str]]:
    """`data.fewshot` as chat turns: a user message and the assistant's answer per example."""
    turns = []
    for i, example in enumerate(examples):
        if set(example) != {"user", "assistant"}:
            raise MilesUserError(
                f"data.fewshot[{i}] has keys {sorted(example)}: each example is {{user: <question>, "
                "assistant: <worked answer>}"
            )
        turns += [
            {"role": "user", "content": str(example["user"])},
            {"role": "assistant", "content": str(example["assistant"])},
        ]
    return turns


class PromptFormatter:
    """Turns a prompt (text or chat messages) into token ids: a configured template, else the chat template."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, use_chat_template: bool = True) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        if cfg.fewshot and not self.use_chat_template:
            raise MilesUserError(
                "data.fewshot adds chat turns, and no chat template is in use to put them in (the tokenizer has "
                "none, or model.chat_template=false): use a chat model, or write the examples into "
                "data.prompt_template instead"
            )
        self.fewshot = fewshot_turns(cfg.fewshot)

    def messages(self, prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.cfg.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        if self.fewshot:
            system = 1 if messages[0].get("role") == "system" else 0
            messages[system:system] = self.fewshot
        return messages

    def text(self, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """`tools`: OpenAI-style tool definitions for the chat template (`miles serve`'s chat completions)."""
        if self.cfg.prompt_template is not None:
            content = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)
            try:
                return self.cfg.prompt_template.format(prompt=content)
            except (KeyError, IndexError, ValueError) as e:  # `{question}`, `{}`, a lone brace
                raise MilesUserError(
                    f"data.prompt_template={self.cfg.prompt_template!r} cannot be filled in ({type(e).__name__}: "
                    f"{e}): it takes {{prompt}} only; write a literal brace as {{{{ or }}}}"
                ) from e
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                self.messages(prompt), tools=tools, tokenize=False, add_generation_prompt=True
            )
        return prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)

    def ids(self, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return list(self.tokenizer(self.text(prompt, tools), add_special_tokens=False)["input_ids"])


def to_samples(
    rows: list[PromptRow], formatter: PromptFormatter, max_prompt_length: int
) -> tuple[list[Sample], int]:
    """Tokenise rows (one batched tokenizer call); over-long prompts are dropped and counted, never a crash."""
    if not rows:
        return [], 0
    texts = [formatter.text(row.prompt) for row in rows]
    all_ids = formatter.tokenizer(texts, add_special_tokens=False)["input_ids"]
    samples, dropped = [], 0
    for row, ids in zip(rows, all_ids):
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        samples.append(
            Sample(prompt=row.prompt, prompt_ids=list(ids), label=row.label, metadata=dict(row.metadata))
        )
    if dropped:
        log.warning(
            "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
            dropped,
            len(rows),
            max_prompt_length,
        )
    return samples, dropped


class PromptLoader:
    """Endless, epoch-shuffled batches of prompt `Sample`s."""

    def __init__(self, prompts: list[Sample], batch_size: int, shuffle: bool, seed: int) -> None:
        if not prompts:
            raise MilesUserError("no usable prompts (all were dropped or the dataset is empty)")
        self.prompts, self.batch_size, self.shuffle = prompts, batch_size, shuffle
        self.rng = random.Random(seed)
        self.epoch, self._order, self._pos = 0, list(range(len(prompts))), len(prompts)

    def next_batch(self) -> list[Sample]:
        batch: list[Sample] = []
        while len(batch) < self.batch_size:
            if self._pos >= len(self._order):
                if self.shuffle:
                    self.rng.shuffle(self._order)
                self._pos = 0
                self.epoch += 1
            batch.append(self.prompts[self._order[self._pos]])
            self._pos += 1
        return batch

    def __iter__(self) -> Iterator[list[Sample]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: epoch, order, next index and the shuffle RNG's state."""
        version, internal, gauss = self.rng.getstate()
        return {
            "epoch": self.epoch,
            "order": list(self._order),
            "pos": self._pos,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["order"]) != len(self.prompts):
            raise MilesUserError(
                f"the checkpoint's prompt loader held {len(state['order'])} prompts and this run has "
                f"{len(self.prompts)}: resume with the data settings the run started with"
            )
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.epoch, self._order, self._pos = (
            int(state["epoch"]),
            [int(i) for i in state["order"]],
            int(state["pos"]),
        )
