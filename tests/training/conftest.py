import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is faster than two and, on a shared CI runner,
    immune to oversubscription (measured here: a 200-step run took 1 s alone, 100 s with two
    threads while other suites ran). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
