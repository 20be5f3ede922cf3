import os

import pytest
import torch

from tests.support.models import OVERLAP_MODE
from tests.support.scheduling import slow_files_first, whole_files_in_collection_order

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(1)  # tiny models on 2 shared cores: one intra-op thread is much faster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the long files go out first (support/scheduling.py)
        slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`-n 2` (xdist's default `load`): whole files, one at a time, in the workers' (slow-first) order."""
    if config.getvalue("dist") != "load":
        return None  # a --dist the user chose
    return whole_files_in_collection_order(config, log)


@pytest.fixture(autouse=True)
def _fresh_compiled_kernels(request: pytest.FixtureRequest) -> None:
    """Each GPU test compiles its own kernels: shared over the session, torch.compile's recompile limit
    (other shapes, dtypes, grad modes) would switch the fused kernels off for the tests after."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        from miles.models import fused

        fused.reset()


@pytest.fixture(params=["off", "on"], ids=["sync", "overlap"])
def overlap_mode(request: pytest.FixtureRequest) -> str:
    """Runs an engine test with both step loops: the plain one and overlap scheduling (CUDA's default)."""
    OVERLAP_MODE["value"] = request.param
    return request.param
