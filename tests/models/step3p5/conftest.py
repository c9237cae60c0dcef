import pytest
import torch


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded CI box two spinning threads per
    matmul make these tests ~50x slower. Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
