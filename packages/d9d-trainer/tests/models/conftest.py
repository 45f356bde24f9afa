import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine they oversubscribe."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
