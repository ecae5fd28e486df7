"""Per-head row scatter into a ``[B, M, H, D]`` cache region, as one Triton kernel.

Why: TempCache writes each chunk's keys and values into history rows picked per head (a merged
group's representative, the slot an unmatched token takes, a merged slot's rescaled value).
``index_copy_`` on a flat ``[M * H, D]`` view runs a thread per element with an index lookup
each, and wants the source transposed head-major first (two passes over the chunk); here a
program reads one index per row and moves the row's D contiguous values straight from the
chunk's ``[N, H, D]`` layout. The inverse of ``kernels/gather_rows.py``.

Semantics (the twin defines them): ``dst[b, index[b, h, i], h] = src[b, i, h]`` in place, for
``dst [B, M, H, D]`` and ``src [B, N, H, D]`` (any strides; cache slices are written and read in
place) and ``index [B, H, N]`` int64 with values in ``[0, M)``. A row written more than once
(TempCache's dump row) takes one of its writes, which one is unspecified. The twin raises on an
index out of range; the kernel clamps it (no host sync), as the gather kernel does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .gather_rows import _indexed_rows

__all__ = ["scatter_rows", "scatter_rows_auto", "scatter_rows_torch"]

_ROWS = 32  # rows per program: 32 x 128 bf16 = 8 KiB moved per program


def _check(dst: Tensor, index: Tensor, src: Tensor) -> None:
    if dst.ndim != 4 or src.ndim != 4:
        raise ValueError(f"dst and src must be [B, M, H, D] / [B, N, H, D], got {tuple(dst.shape)} / {tuple(src.shape)}")
    b, _, h, d = dst.shape
    if index.dtype != torch.int64 or index.ndim != 3 or index.shape[:2] != (b, h):
        raise ValueError(f"index must be int64 [B={b}, H={h}, N], got {index.dtype} {tuple(index.shape)}")
    if tuple(src.shape) != (b, index.shape[2], h, d) or src.dtype != dst.dtype:
        raise ValueError(f"src must be {dst.dtype} [B, N, H, D] = [{b}, {index.shape[2]}, {h}, {d}], "
                         f"got {src.dtype} {tuple(src.shape)}")
    if not index.device == src.device == dst.device:
        raise ValueError(f"device mismatch: dst on {dst.device}, index on {index.device}, src on {src.device}")


def scatter_rows_torch(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """Reference twin: ``scatter_`` along rows with the index expanded over D; returns ``dst``.
    ``src`` is copied first: it may be a view of other rows of ``dst``'s buffer (the open chunk)."""
    _check(dst, index, src)
    idx = index.transpose(1, 2)[..., None].expand(-1, -1, -1, dst.shape[3])
    return dst.scatter_(1, idx, src.clone())


if HAS_TRITON:

    @triton.jit(do_not_specialize=["H", "M", "N"])
    def _scatter_rows_kernel(dst_ptr, index_ptr, src_ptr, H, M, N,
                             stride_db, stride_dm, stride_dh, stride_dd,
                             stride_sb, stride_sn, stride_sh, stride_sd,
                             ROWS: tl.constexpr, D: tl.constexpr):
        """One program: ``ROWS`` consecutive source rows of one head."""
        b, h, rows, ok, dst_rows = _indexed_rows(index_ptr, H, M, N, ROWS)
        offs_d = tl.arange(0, D)
        vals = tl.load(src_ptr + b * stride_sb + h * stride_sh + rows.to(tl.int64)[:, None] * stride_sn
                       + offs_d[None, :] * stride_sd, mask=ok[:, None])
        tl.store(dst_ptr + b * stride_db + h * stride_dh + dst_rows[:, None] * stride_dm
                 + offs_d[None, :] * stride_dd, vals, mask=ok[:, None])


def scatter_rows(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two); grid ``(ceil(N / 32), B * H)``."""
    if not HAS_TRITON:
        raise RuntimeError("scatter_rows needs triton, which is not importable")
    _check(dst, index, src)
    b, m, h, d = dst.shape
    check_row_kernel(dst, d)
    n = index.shape[2]
    if n == 0 or b * h == 0:
        return dst
    if m == 0:
        raise ValueError("index into an empty dst (M = 0)")
    _scatter_rows_kernel[(triton.cdiv(n, _ROWS), b * h)](dst, index.contiguous(), src, h, m, n, *dst.stride(),
                                                         *src.stride(), ROWS=_ROWS, D=d, num_warps=4)
    return dst


def scatter_rows_auto(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = dst.shape[-1] if dst.ndim == 4 else 0
    fn = scatter_rows if use_kernel(dst, power_of_two(d)) else scatter_rows_torch
    return fn(dst, index, src)
