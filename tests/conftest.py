"""Where the suite's Triton kernels run: natively on a CUDA machine, else under Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when it first initialises, so it is set here, before any test
module is imported, and nowhere else: on a GPU machine plain ``pytest`` then compiles for the GPU
and runs the ``cuda``-marked tests, which are skipped elsewhere. A kernel test puts its tensors on
the ``device`` fixture's device, never on the CPU by itself: without the interpreter Triton cannot
run there.
"""
import os
from dataclasses import dataclass

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Chunk:
    """The attention shapes of one chunk: heads, head dim, tokens per frame, frames per chunk."""

    heads: int
    head_dim: int
    frame_tokens: int
    frames: int = 3

    @property
    def tokens(self) -> int:
        return self.frame_tokens * self.frames

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


#: Wan 2.1 1.3B's chunk: 12 heads of 128, 1560 tokens a frame, 3 frames (the 14B has 40 heads).
WAN_1_3B = Chunk(heads=12, head_dim=128, frame_tokens=1560)
#: A stand-in the interpreter runs in seconds: the same structure, a few heads and tokens.
SMALL = Chunk(heads=2, head_dim=32, frame_tokens=40)


class Device(str):
    """The device a kernel test's tensors go on: "cuda" (Triton compiles for the GPU) or "cpu"
    (Triton's interpreter). ``chunk`` is the shape to test at: Wan 1.3B's chunk natively, a small
    one interpreted; ``pick(cpu, cuda)`` chooses any other size the same way."""

    def pick(self, cpu, cuda):
        return cuda if self == "cuda" else cpu

    @property
    def chunk(self) -> Chunk:
        return self.pick(SMALL, WAN_1_3B)


@pytest.fixture
def device() -> Device:
    """The kernel tests' device (skips where Triton is not importable: no kernel runs there)."""
    pytest.importorskip("triton", reason="triton not importable")
    return Device("cuda" if CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
    """``cuda``-marked tests need the GPU: skipped without one."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture
def twins(monkeypatch):
    """The torch twins instead of the interpreted kernels, for tests of a policy (what a plan reads,
    how much mass it keeps), not of a kernel: the twins define the kernels' semantics, and the kernel
    tests hold the kernels to them. The interpreter runs such tests ~10x slower."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
