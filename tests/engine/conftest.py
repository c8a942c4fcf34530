import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One thread, as tests/training/conftest.py: the demo model runs several times faster so on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
