"""How `pytest -n 2` (CI) spreads the suite over its workers: whole test files, handed out one at a time as a
worker runs short of tests, the files with the most `slow` tests first.

xdist's default (`load`) gives each worker a fixed run of consecutive tests up front; one run held most of the
long tests of tests/miles/ (the loop, Ray, resume), so one worker ground through it while the other finished
everything else and stood idle for minutes. A whole file at a time keeps a module's fixtures (a Ray cluster,
a served engine) set up once, and the long files first leave only short ones for the end."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest


def slow_files_first(items: list[pytest.Item]) -> None:
    """Reorders `items` in place: files by their number of `slow` tests, most first; the order within a
    file, and among files with as many, stays the collection's."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    position: dict[Any, int] = {}
    for item in items:
        position.setdefault(item.path, len(position))
    items.sort(key=lambda item: (-slow[item.path], position[item.path]))


def whole_files_in_collection_order(config: pytest.Config, log: Any) -> Any:
    """xdist's `loadfile` scheduler, files handed out in the (reordered) collection's order rather than by
    their number of tests."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)
