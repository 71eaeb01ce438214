"""Set-up for test_all.py and tests/: the Triton kernels run under the interpreter on CPU (set before
triton is imported), one Inductor cache per pytest-xdist worker, one intra-op thread per test module."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    # pytest -n: one Inductor cache per worker process, so no two processes write one entry
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                         os.environ["PYTEST_XDIST_WORKER"])

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The nano models are launch-bound: one intra-op thread is as fast as two and does not
    collapse when another process holds the second core (OpenMP threads spin-waiting)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
