"""DeepSpeed's checkpoint engine with its loads restricted: DeepSpeed reads every shard file through
`engine.checkpoint_engine.load`, which for `TorchCheckpointEngine` is `torch.load(weights_only=False)` (any
pickle runs). Wrapped, each load is `miles.safe_unpickle.load_deepspeed_state` (weights-only plus the DeepSpeed
classes its state holds); saving, commits and the rest stay the engine's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.errors import MilesUserError
from miles.safe_unpickle import check_deepspeed_files, load_deepspeed_state


class SafeLoadingCheckpointEngine:
    """`inner` (the checkpoint engine DeepSpeed made) with `load` replaced; every other attribute is its."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_state(path, map_location)


def restrict_checkpoint_loading(engine: Any) -> None:
    """Route `engine`'s checkpoint loads through `SafeLoadingCheckpointEngine` (once)."""
    if not isinstance(engine.checkpoint_engine, SafeLoadingCheckpointEngine):
        engine.checkpoint_engine = SafeLoadingCheckpointEngine(engine.checkpoint_engine)


def check_loadable(engine: Any, state: Path) -> None:
    """Refuse, on every rank alike, a `state` folder with a file holding more than DeepSpeed's state
    (`check_deepspeed_files`), and DeepSpeed's universal-checkpoint load (it reads its files with
    `torch.load(weights_only=False)` itself, past the checkpoint engine)."""
    check_deepspeed_files(state)
    if engine.load_universal_checkpoint():
        raise MilesUserError(
            "trainer.deepspeed_extra turns on DeepSpeed's universal checkpoint loading, which unpickles its "
            "files without restriction; miles does not resume that way: drop "
            "trainer.deepspeed_extra.checkpoint.load_universal"
        )
