"""Without a GPU, every Triton kernel in the suite runs under Triton's CPU interpreter.

The kernel test files set ``TRITON_INTERPRET=1`` at import, but Triton reads it when it first
initialises, so a test file that imported Triton earlier (any run that starts with a file of the
library's own, e.g. ``pytest tests/test_tempcache.py tests/test_ann.py``) would leave Triton with
no driver. Set here, before any test module is imported, the order of files no longer matters.
On a CUDA machine nothing changes: the CUDA-only tests need the native path.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def twins(monkeypatch):
    """The torch twins instead of the interpreted kernels, for tests of a policy (what a plan reads,
    how much mass it keeps), not of a kernel: the twins define the kernels' semantics, and the kernel
    tests hold the kernels to them. The interpreter runs such tests ~10x slower."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
