"""The pickles a resume reads, read without running code: a checkpoint folder someone handed you must not be
able to do anything but fail to load.

Two kinds of pickle remain in a checkpoint (weights themselves are safetensors):
- the distributed optimizer's `torch.distributed.checkpoint` metadata (`optimizer_shards/.metadata`), read by
  `load_dcp_metadata` with an unpickler that builds only `DCP_METADATA_GLOBALS`;
- DeepSpeed's shard files (`deepspeed/state/*.pt`), read by `load_deepspeed_state`: `torch.load` with
  `weights_only=True` plus `DEEPSPEED_STATE_GLOBALS`.

Both lists are what the checkpoints miles writes hold (recorded from saves in every configuration the tests
run: data, tensor and expert parallelism; ZeRO 1/2/3, bf16, CPU offload). Anything else is refused.
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

from miles.errors import MilesUserError

DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    }
)
"""(module, name) of every global a DCP `.metadata` miles writes names, besides torch dtypes (`torch.float32`:
allowed by value, see `_is_dtype`). `BytesStorageMetadata` is left out on purpose: miles saves tensors only,
and DCP reads an entry it marks as bytes with `torch.load(weights_only=False)`."""

DEEPSPEED_STATE_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The DeepSpeed classes its ZeRO shard files hold beyond what `torch.load(weights_only=True)` builds already
(tensors, storages, `torch.Size`, `OrderedDict`, builtins)."""


def refusal(path: Path | str, what: str) -> MilesUserError:
    """The error for a checkpoint file that holds `what`, which no checkpoint miles writes does."""
    return MilesUserError(
        f"{path} holds {what}, which no checkpoint miles writes does: it is not a checkpoint miles wrote and "
        "may be malicious, so it was not loaded. Resume only from checkpoints your own runs wrote."
    )


def _is_dtype(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the allowed globals; every other one (a function to call, a class to make) is refused."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise refusal(self.path, f"a reference to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self.path, "a persistent object")


def load_dcp_metadata(path: Path) -> Any:
    """The `torch.distributed.checkpoint` `Metadata` pickled in `path`, built from allowed globals only; a
    file that holds anything else, or a non-tensor entry, is refused (`refusal`) before it is used."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not path.is_file():
        raise MilesUserError(
            f"{path} is missing: this checkpoint's shards are incomplete; resume another one"
        )
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, path).load()
        except MilesUserError:
            raise
        except Exception as err:  # truncated, or allowed classes given arguments they reject
            raise MilesUserError(
                f"{path} is not a torch.distributed.checkpoint metadata file miles can read ({err}); the "
                "checkpoint is damaged or was not written by miles"
            ) from err
    if not isinstance(metadata, Metadata):
        raise refusal(path, f"a {type(metadata).__name__} (not DCP metadata)")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise refusal(path, f"a {type(entry).__name__} entry ({key!r}; miles saves tensors only)")
    for info in (metadata.storage_data or {}).values():
        if Path(info.relative_path).name != info.relative_path or info.relative_path in ("", ".", ".."):
            raise refusal(path, f"a data file outside its folder ({info.relative_path!r})")
    return metadata


def _deepspeed_globals() -> list[Any]:
    found = []
    for dotted in DEEPSPEED_STATE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        found.append(getattr(importlib.import_module(module), name))
    return found


def load_deepspeed_state(path: Path | str, map_location: Any = None) -> Any:
    """A DeepSpeed checkpoint file (`torch.save` format): `torch.load(weights_only=True)`, with the DeepSpeed
    classes of `DEEPSPEED_STATE_GLOBALS` allowed for this call only. Anything else is refused (`refusal`)."""
    import torch

    with torch.serialization.safe_globals(_deepspeed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            # torch names the global it refused in "Unsupported global: GLOBAL <name>"
            named = re.search(r"GLOBAL (\S+)", str(err))
            what = f"a reference to {named.group(1)}" if named else "an object outside the allowed types"
            raise refusal(path, what) from err


def check_deepspeed_files(folder: Path) -> None:
    """Refuse (`refusal`) a DeepSpeed checkpoint folder any of whose `.pt` files names a global outside the
    allowed ones: a static scan of each file's pickle, no tensor read. Each rank runs it over every file, so a
    bad shard is refused on all ranks alike (DeepSpeed loads only a rank's own shard: one rank failing alone
    would leave the others waiting in a collective)."""
    import torch

    with torch.serialization.safe_globals(_deepspeed_globals()):
        for path in sorted(folder.rglob("*.pt")):
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            except ValueError:  # not torch's zip format: `load_deepspeed_state` (weights-only) checks it
                continue
            if unsafe:
                raise refusal(path, f"a reference to {sorted(unsafe)[0]}")
