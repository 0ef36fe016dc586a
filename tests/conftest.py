import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The test models are tiny: on the 2-core CI machine OpenMP threads mostly spin against each other
    # (the healthy example took 75 s instead of 5 s under load). Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
