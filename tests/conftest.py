"""Where the suite's Triton kernels run: natively on a CUDA machine, else under Triton's CPU interpreter;
and the ComfyUI tree the ``comfyui`` tests run against.

Triton reads ``TRITON_INTERPRET`` when it first initialises, so it is set here, before any test
module is imported, and nowhere else: on a GPU machine plain ``pytest`` then compiles for the GPU
and runs the ``cuda``-marked tests, which are skipped elsewhere. A kernel test puts its tensors on
the ``device`` fixture's device, never on the CPU by itself: without the interpreter Triton cannot
run there.

ComfyUI: a test reaches a ComfyUI tree only through the ``comfy`` fixture (``COMFYUI_PATH``'s tree,
imported by ``comfyui_fastar.testing.comfy_harness``), which skips where ``COMFYUI_PATH`` is unset, and
every test that uses it is marked ``comfyui``: ``.ci/comfy_tests.sh`` runs ``-m comfyui`` against each
tree (collection fails on a test that uses the fixture unmarked, so none can drop out of that run). The
``comfyui`` tests that need core ComfyUI's autoregressive path (``comfy/ldm/wan/ar_model.py``) are also
marked ``core_ar``: skipped against a tree without it here, deselected there by the CI script, which
fails unless some tree ran them; likewise ``taehv`` for the tests that need core's TAEHV fast decoders
(``comfy/taesd/taehv.py``).
"""
import os
from dataclasses import dataclass
from pathlib import Path

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


@pytest.fixture(autouse=True)
def annsa_on_any_history(monkeypatch):
    """AnnSA's mechanics are tested on histories far shorter than any where its sparse call pays
    (``annsa.MIN_HISTORY_RATIO``); the tests of that rule set it back."""
    from comfyui_fastar.fastar import annsa

    monkeypatch.setattr(annsa, "MIN_HISTORY_RATIO", 0.0)


@pytest.fixture
def device() -> Device:
    """The kernel tests' device (skips where Triton is not importable: no kernel runs there)."""
    pytest.importorskip("triton", reason="triton not importable")
    return Device("cuda" if CUDA else "cpu")


#: What a ComfyUI tree holds where it has core's autoregressive video path (the ``core_ar`` tests), and where
#: it has core's TAEHV fast decoders (the ``taehv`` tests).
CORE_AR_FILE = "comfy/ldm/wan/ar_model.py"
TAEHV_FILE = "comfy/taesd/taehv.py"


def pytest_collection_modifyitems(config, items):
    """``cuda``-marked tests need the GPU: skipped without one. ``core_ar``-marked ones need a ComfyUI tree
    with core's autoregressive path: skipped against one without it. A test that uses the ``comfy``
    fixture or is marked ``core_ar`` must be marked ``comfyui``: the run stops otherwise."""
    unmarked = [item.nodeid for item in items if not item.get_closest_marker("comfyui")
                and ("comfy" in getattr(item, "fixturenames", ()) or item.get_closest_marker("core_ar")
                     or item.get_closest_marker("taehv"))]
    if unmarked:
        raise pytest.UsageError("these tests run against a ComfyUI tree but are not marked comfyui (what "
                                ".ci/comfy_tests.sh selects by): " + ", ".join(unmarked))
    tree = os.environ.get("COMFYUI_PATH")
    core_ar = pytest.mark.skip(reason=f"the ComfyUI tree at COMFYUI_PATH has no {CORE_AR_FILE} (core's "
                                      "autoregressive path)")
    taehv = pytest.mark.skip(reason=f"the ComfyUI tree at COMFYUI_PATH has no {TAEHV_FILE} (core's TAEHV)")
    cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") and not CUDA:
            item.add_marker(cuda)
        if item.get_closest_marker("core_ar") and tree and not Path(tree, CORE_AR_FILE).is_file():
            item.add_marker(core_ar)
        if item.get_closest_marker("taehv") and tree and not Path(tree, TAEHV_FILE).is_file():
            item.add_marker(taehv)


# -- ComfyUI ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's ``comfy`` package from the tree at ``COMFYUI_PATH``, on the CPU (skips where it is unset)."""
    from comfyui_fastar.testing import comfy_harness

    tree = comfy_harness.comfyui_path()
    if not tree:
        pytest.skip("COMFYUI_PATH is not set (no ComfyUI tree to test against)")
    if not Path(tree).is_dir():
        pytest.skip(f"COMFYUI_PATH ({tree}) is not a folder")
    return comfy_harness.import_comfy(tree)


@pytest.fixture(scope="session")
def pack(comfy):
    """The node package, with the modules the tests call into imported (they import ComfyUI)."""
    from comfyui_fastar import nodes
    from comfyui_fastar.nodes import engines, patching, samplers, settings, wan  # noqa: F401

    return nodes


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The tiny random Wan 2.1 T2V checkpoint (``comfy_harness.tiny_wan``) as ComfyUI loads it, fp32."""
    from comfyui_fastar.testing import comfy_harness

    return comfy_harness.write_wan(comfy_harness.tiny_wan(), tmp_path_factory.mktemp("ckpt"), "wan_tiny")[0]


@pytest.fixture(scope="session")
def vae(comfy, tmp_path_factory):
    """A Wan 2.1 VAE with random weights (``comfy_harness.wan_vae_file``), as ComfyUI's Load VAE gives it."""
    from comfyui_fastar.testing import comfy_harness

    path = comfy_harness.wan_vae_file(tmp_path_factory.mktemp("vae") / "wan_2.1_vae.safetensors")
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))


@pytest.fixture
def twins(monkeypatch):
    """The torch twins instead of the interpreted kernels, for tests of a policy (what a plan reads,
    how much mass it keeps), not of a kernel: the twins define the kernels' semantics, and the kernel
    tests hold the kernels to them. The interpreter runs such tests ~10x slower."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
