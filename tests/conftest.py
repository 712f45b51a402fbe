"""Test-session set-up shared by every phase's suite.

Triton kernels run on CPU tensors under the interpreter, and the interpreter must be switched on
before any `@triton.jit` function is defined, so this happens here, first. GPU-only tests carry
`@pytest.mark.gpu` and are skipped where no CUDA device exists.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
