"""Triton kernels, each beside a torch reference twin with the same signature.

``kernels/NAME.py`` holds ``NAME`` (the Triton wrapper: checks, then launches; raises where Triton
cannot run), ``NAME_torch`` (the twin: it defines the semantics, documented once in the module or
twin docstring, and the kernel's tests hold the kernel to it) and ``NAME_auto`` (the dispatcher
callers use, deciding by :func:`use_kernel`). ``rows.py`` holds one kernel's two directions,
``gather_rows`` and ``scatter_rows``, each with that trio.

By paper component:

- TempCache: ``unit_fp8`` and ``row_argmax`` (the fp8 match), ``pair_cosine`` (the merge test),
  ``merge_rows`` (the group means), ``rows`` (history writes; the heads' alignment).
- AnnSA: ``block_means``, ``quant_block_scores`` / ``quant_block_shares`` and ``quant_select``
  (the plan), ``block_sparse_attention`` (the attention), with the plan format in ``plan.py``
  and the launch model in ``launch.py``; ``rows`` re-sorts the history.
- The Wan forward: ``adaln``, ``qk_norm_rope``, ``fp8_linear`` (the blocks' linear layers in fp8, opt-in).
- On Hopper, where FlashAttention-4 is installed: ``flash4`` (dense attention, TempCache's bias folded
  into the keys, AnnSA's block plans), a library's kernels rather than one of ours, with no twin of its
  own: the attention math it replaces is the twin.

Triton is optional (absent on macOS, Windows and CPU-only installs): the twins run there.
"""
import os

import torch

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


def use_kernel(t, fits: bool = True, *, interpreted: bool = True) -> bool:
    """Every dispatcher's choice: the kernel where the call ``fits`` it (dtypes and shapes, which
    the dispatcher tests) and Triton runs on ``t``'s device, else the twin. ``interpreted=False``
    keeps off Triton's CPU interpreter the kernels every model forward calls (adaLN, q/k norm +
    RoPE): whole forwards would crawl there, so the twin runs and the tests call the kernel."""
    if torch.is_grad_enabled() and getattr(t, "requires_grad", False):
        return False  # the kernels have no backward: autograd (training) runs the twins
    return bool(fits) and triton_runs_on(t) and (interpreted or t.is_cuda)


def check_triton_runs_on(t) -> None:
    """A kernel wrapper's device requirement, as an error that names it."""
    if not triton_runs_on(t):
        raise ValueError(f"kernel needs CUDA tensors (or CPU with TRITON_INTERPRET=1), got device {t.device}")


def power_of_two(n: int) -> bool:
    """Whether n is 1, 2, 4, ...: a size a Triton tile takes whole."""
    return n >= 1 and not n & (n - 1)


def check_row_kernel(t, d: int) -> None:
    """The per-row kernels' launch requirements (head dim D a power of two, a device Triton runs
    on), as errors that name them, in that order."""
    if not power_of_two(d):
        raise ValueError(f"kernel needs D a power of two, got D={d}")
    check_triton_runs_on(t)
