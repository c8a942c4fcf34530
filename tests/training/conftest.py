import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: one thread runs them several times faster than two on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
