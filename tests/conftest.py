import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
