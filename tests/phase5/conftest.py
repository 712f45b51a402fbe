"""Phase 5 tests run the tiny model on one thread.

Its matmuls are too small to split: on a shared 2-core machine, two threads spin against each other
and the rest of the machine and make the engine tests ~10x slower. Restored after the package.
"""

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
