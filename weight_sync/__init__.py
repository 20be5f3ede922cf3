"""Moving weights trainer -> engine, with versions and checksums.

`inprocess`: `InProcessWeightSync(policy, engine)`, both in one process. Across processes
(`cuda_ipc`, `shm`, `broadcast`): a sender on the trainer's sending rank (`make_sender`), an
`EngineSyncTarget` next to each engine, and `TransportWeightSync(policy, sender).sync(version)` in the loop.
`shm` and `cuda_ipc` sync the torch backend's parameters direct (the engine copies straight from the
trainer's storages, shared once; direct_sender.py) and converted streams (megatron) through buckets.
"""

from miles.weight_sync.channel import Channel
from miles.weight_sync.checksum import compare, fingerprint_on_device, fingerprints, tensor_fingerprint
from miles.weight_sync.direct import persistent_tensors
from miles.weight_sync.direct_sender import DirectSender
from miles.weight_sync.inprocess import InProcessWeightSync, SyncResult, iter_buckets
from miles.weight_sync.protocol import TRANSPORT_CODES, TRANSPORTS, SyncError, SyncRefused, SyncTimeout
from miles.weight_sync.receiver import WeightReceiver
from miles.weight_sync.result import TransportSyncResult
from miles.weight_sync.sender import WeightSender
from miles.weight_sync.target import EngineSyncTarget
from miles.weight_sync.transport_sync import TransportWeightSync, trainer_stream
from miles.weight_sync.transports import check_transport, make_receiver, make_sender

__all__ = [
    "TRANSPORTS",
    "TRANSPORT_CODES",
    "Channel",
    "DirectSender",
    "EngineSyncTarget",
    "InProcessWeightSync",
    "SyncError",
    "SyncRefused",
    "SyncResult",
    "SyncTimeout",
    "TransportSyncResult",
    "TransportWeightSync",
    "WeightReceiver",
    "WeightSender",
    "check_transport",
    "compare",
    "fingerprint_on_device",
    "fingerprints",
    "iter_buckets",
    "make_receiver",
    "make_sender",
    "persistent_tensors",
    "tensor_fingerprint",
    "trainer_stream",
]
