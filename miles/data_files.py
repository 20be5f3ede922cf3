"""Reading a data file's records with errors that name the file, the line or row, and what to do.

JSON Lines (and .json) are read here line by line rather than by `datasets`' json loader, whose failures are a
library traceback with no file or line (a bare StopIteration for an empty file, a pyarrow error for one bad line
or for a column holding both numbers and text). Parquet and saved datasets go through `datasets`; their failures
are wrapped with the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.errors import MilesUserError

EXAMPLE_ROW = '{"prompt": "What is 2+3?", "label": "5"}'


@dataclass
class Records:
    """A data file's rows, and where each came from (for error messages)."""

    rows: list[dict[str, Any]]
    source: str
    """The path as the user gave it."""
    lines: list[int] | None = None
    """JSON Lines: each row's line number in the file (blank lines are skipped, numbers stay the file's)."""

    def where(self, index: int) -> str:
        """`FILE:LINE` for a jsonl row, `FILE row N` (from 1) for the others."""
        if self.lines is not None:
            return f"{self.source}:{self.lines[index]}"
        return f"{self.source} row {index + 1}"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return f"number ({type(value).__name__})"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is no error
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise MilesUserError(
            f"{path}:{line} is not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); save the file as "
            "UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None


def _no_rows(path: Path) -> MilesUserError:
    return MilesUserError(
        f"{path} has no rows (it is empty or holds only blank lines); a jsonl data file holds one JSON object "
        f"per line, e.g. {EXAMPLE_ROW}"
    )


def read_jsonl(path: Path, source: str | None = None) -> Records:
    """A JSON Lines file's objects. Every failure names FILE:LINE: bytes that are not UTF-8, a line that is not
    JSON (or nested past the parser's depth), a line that is not an object, a file with no rows."""
    text = _decode(path, path.read_bytes())
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise MilesUserError(
                f"{path}:{number} is not valid JSON ({e.msg} at column {e.colno}); fix or remove that line (each "
                f"line is one JSON object, e.g. {EXAMPLE_ROW})"
            ) from None
        except RecursionError:
            raise MilesUserError(
                f"{path}:{number} is nested too deeply to read; fix or remove that line"
            ) from None
        if not isinstance(value, dict):
            raise MilesUserError(
                f"{path}:{number} is a JSON {json_type(value)}, not an object; each line must be one object, "
                f"e.g. {EXAMPLE_ROW}"
            )
        rows.append(value)
        lines.append(number)
    if not rows:
        raise _no_rows(path)
    return Records(rows, source or str(path), lines)


def read_json(path: Path, source: str | None = None) -> Records:
    """A .json file: an array of objects, or JSON Lines under a .json name (as `datasets` accepted both)."""
    data = path.read_bytes()
    text = _decode(path, data)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return read_jsonl(path, source)  # several lines of objects, or a broken file: jsonl names the line
    if isinstance(value, dict):
        return read_jsonl(path, source)
    if not isinstance(value, list):
        raise MilesUserError(f"{path} holds a JSON {json_type(value)}; use an array of objects or JSON Lines")
    for index, row in enumerate(value):
        if not isinstance(row, dict):
            raise MilesUserError(
                f"{path} row {index + 1} is a JSON {json_type(row)}, not an object; each row must be an object, "
                f"e.g. {EXAMPLE_ROW}"
            )
    if not value:
        raise _no_rows(path)
    return Records(value, source or str(path))


def read_parquet(path: Path, source: str | None = None) -> Records:
    import datasets

    try:
        rows = list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    except Exception as e:  # pyarrow's and datasets' own errors: a truncated or foreign file
        raise MilesUserError(
            f"{path} cannot be read as parquet ({type(e).__name__}: {_first_line(e)}); it is probably truncated "
            "or not parquet: write it again (e.g. `pandas.DataFrame(rows).to_parquet(path)`) or use jsonl"
        ) from e
    if not rows:
        raise MilesUserError(f"{path} has no rows; a data file needs at least one row with a prompt")
    return Records(rows, source or str(path))


def load_saved_dataset(path: Path) -> Any:
    """`datasets.load_from_disk`, with a folder that is not a saved dataset named as such."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # FileNotFoundError for a plain folder; arrow errors for damaged files
        raise MilesUserError(
            f"{path} is not a saved dataset that can be read ({type(e).__name__}: {_first_line(e)}); pass a "
            "folder written by `datasets`' save_to_disk, or a .jsonl / .parquet file"
        ) from e


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
