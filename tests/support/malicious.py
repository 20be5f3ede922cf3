"""A crafted pickle for the checkpoint-loading refusal tests: unpickling it runs `touch <marker>` (through
`os.system`), so a marker file that appears means a loader ran code from a checkpoint."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class TouchesMarker:
    """Pickles as a call of `os.system("touch <marker>")`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def malicious_pickle(marker: Path) -> bytes:
    return pickle.dumps(TouchesMarker(marker))
