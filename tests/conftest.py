import os

import pytest
import torch

# The fused weight-pass kernels compile on a background thread for seconds of CPU: only the tests of the
# fused path turn them on (tests/test_fused.py), so the other tests measure the eager path they were written for.
os.environ.setdefault("TELEMETRY_COMPILE", "0")


@pytest.fixture(autouse=True)
def one_thread():
    # The test models are tiny: on the 2-core CI machine OpenMP threads mostly spin against each other
    # (the healthy example took 75 s instead of 5 s under load). Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[1, 3], ids=["one-thread", "three-threads"])
def pass_threads(request, monkeypatch):
    """Runs a test with the memory-bound passes on one thread (the weight pass over whole tensors, as for any
    small model), and again split over three threads in small chunks, whatever the model's size, so the
    chunked pass, the split and the combination of the parts are what is tested."""
    import telemetry

    if request.param > 1:
        monkeypatch.setattr(telemetry, "CHUNK_BYTES", 256)
        monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
        monkeypatch.setattr(telemetry, "_pass_threads",
                            lambda tensors: request.param if all(t.device.type == "cpu" for t in tensors) else 1)
    return request.param
