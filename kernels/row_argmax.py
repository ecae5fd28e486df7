"""Each row's argmax of a score matrix, as one Triton kernel.

Why: TempCache's fp8 match reduces a large score block per GEMM, and a program per row streaming
it with a running maximum per lane reads it faster than ``torch.argmax``.

Semantics (the twin defines them): for ``scores [R, M]`` (any strides, M >= 1), the int64 index
of each row's largest value, the smallest such index on ties. NaN is not handled (scores are
finite).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["row_argmax", "row_argmax_auto", "row_argmax_torch"]

_BLOCK = 2048  # values per step of a row: 16 per thread at 4 warps


def _check(scores: Tensor) -> None:
    if scores.ndim != 2 or scores.shape[1] == 0:
        raise ValueError(f"scores must be [R, M] with M >= 1, got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}")


def row_argmax_torch(scores: Tensor) -> Tensor:
    """Reference twin: the first index where each row reaches its maximum."""
    _check(scores)
    return (scores == scores.amax(dim=1, keepdim=True)).int().argmax(dim=1)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _row_argmax_kernel(s_ptr, out_ptr, M, stride_r, stride_m, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, M, BLOCK):
            cols = start + offs
            x = tl.load(s_ptr + row * stride_r + cols.to(tl.int64) * stride_m, mask=cols < M,
                        other=float("-inf")).to(tl.float32)
            upd = x > best  # strict: each lane keeps its earliest maximum
            best = tl.where(upd, x, best)
            best_idx = tl.where(upd, cols, best_idx)
        top = tl.max(best, 0)
        # lanes that never beat -inf hold index 0: where a row is all -inf, 0 is the answer anyway
        idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
        tl.store(out_ptr + row, idx.to(tl.int64))


def row_argmax(scores: Tensor) -> Tensor:
    """Triton kernel with the twin's contract; grid ``R``."""
    if not HAS_TRITON:
        raise RuntimeError("row_argmax needs triton, which is not importable")
    _check(scores)
    check_triton_runs_on(scores)
    r, m = scores.shape
    out = torch.empty(r, dtype=torch.int64, device=scores.device)
    if r:
        _row_argmax_kernel[(r,)](scores, out, m, *scores.stride(), BLOCK=_BLOCK, num_warps=4)
    return out


def row_argmax_auto(scores: Tensor) -> Tensor:
    """The kernel where Triton runs, else the twin."""
    return (row_argmax if use_kernel(scores) else row_argmax_torch)(scores)
