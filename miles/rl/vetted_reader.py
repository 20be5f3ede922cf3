"""The `torch.distributed.checkpoint` reader of the distributed optimizer's shards: torch's `FileSystemReader`
unpickles `.metadata` with plain `pickle.load`; this one reads it with miles's restricted unpickler
(`miles.safe_unpickle.load_dcp_metadata`) when it is made, before DCP asks. The tensor data DCP reads itself,
with `torch.load(weights_only=True)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from miles.safe_unpickle import load_dcp_metadata

METADATA_FILE = ".metadata"


class VettedMetadataReader(FileSystemReader):
    """A `FileSystemReader` of `path` whose metadata was read and checked on construction (a refusal is a
    `MilesUserError` raised here, on every rank alike, not an error DCP wraps inside its collective)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata: Metadata = load_dcp_metadata(Path(path) / METADATA_FILE)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata
