import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # Tiny matmuls gain nothing from intra-op threads, and on a shared 2-core machine a second OpenMP
    # thread waiting for a busy core makes each op orders of magnitude slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
