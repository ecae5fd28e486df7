"""Triton kernels, each beside a torch reference twin with the same signature.

Triton is optional (absent on macOS, Windows and CPU-only installs): the twins run there.
"""
import os

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where Triton is missing
    HAS_TRITON = False


def triton_runs_on(t) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under its interpreter."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
