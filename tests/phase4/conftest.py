"""Phase 4 tests run one intra-op thread: their tiny matmuls gain nothing from a second one, and on
a shared 2-core machine the two threads' contention made each engine step about 4x slower."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
