"""Past one process on the embedded placement: the process-group handle (`comm`), merging every rank's
metrics and samples (`metrics`), starting the ranks (`launcher`) and a started rank's entry (`rank_main`)."""

from miles.distributed.comm import SINGLE, DataParallel, init_data_parallel, shutdown
from miles.distributed.launcher import check_devices, launch, needs_launch, world_from_env
from miles.distributed.metrics import combine_metrics, gather_samples, reduce_metrics

__all__ = [
    "SINGLE",
    "DataParallel",
    "check_devices",
    "combine_metrics",
    "gather_samples",
    "init_data_parallel",
    "launch",
    "needs_launch",
    "reduce_metrics",
    "shutdown",
    "world_from_env",
]
