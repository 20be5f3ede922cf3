"""Moving weights trainer -> engine, with versions and checksums."""

from miles.weight_sync.checksum import compare, fingerprints, tensor_fingerprint
from miles.weight_sync.inprocess import InProcessWeightSync, SyncResult, iter_buckets

__all__ = [
    "InProcessWeightSync",
    "SyncResult",
    "compare",
    "fingerprints",
    "iter_buckets",
    "tensor_fingerprint",
]
