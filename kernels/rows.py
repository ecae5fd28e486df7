"""Per-head row moves between a ``[B, M, H, D]`` cache region and rows in order: the gather and the
scatter, one Triton kernel body for both directions.

Why: AnnSA re-sorts each layer's history by bucket, TempCache's shared match aligns a sorted
history's heads by token (gathers of whole rows of one head, an index per row), and TempCache
writes each chunk's keys and values into history rows picked per head (a scatter). ``torch.gather``
wants the index expanded to every element, ``index_copy_`` a head-major source and an index lookup
per element; here a program reads one index per row and moves its D contiguous values, in the
ordered side's own ``[N, H, D]`` layout.

Semantics (the twins define them), for ``index [B, H, N]`` int64 with values in ``[0, M)``:

- ``gather_rows(src, index)``: ``out[b, i, h] = src[b, index[b, h, i], h]`` for ``src [B, M, H,
  D]`` (any strides; a cache slice is read in place); returns a new contiguous ``[B, N, H, D]``.
- ``scatter_rows(dst, index, src)``: ``dst[b, index[b, h, i], h] = src[b, i, h]`` in place, for
  ``dst [B, M, H, D]`` and ``src [B, N, H, D]`` (any strides; cache slices are written and read in
  place); returns ``dst``. A row written more than once (TempCache's dump row) takes one of its
  writes, which one is unspecified.

The twins raise on an index out of range; the kernels clamp it (no host sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["gather_rows", "gather_rows_auto", "gather_rows_torch", "scatter_rows", "scatter_rows_auto",
           "scatter_rows_torch"]

_ROWS = 32  # rows per program: 32 x 128 bf16 = 8 KiB moved per program


def _check_index(cache: Tensor, index: Tensor, name: str) -> None:
    b, _, h, _ = cache.shape
    if index.dtype != torch.int64 or index.ndim != 3 or index.shape[:2] != (b, h):
        raise ValueError(f"index must be int64 [B={b}, H={h}, N], got {index.dtype} {tuple(index.shape)}")
    if index.device != cache.device:
        raise ValueError(f"device mismatch: {name} on {cache.device}, index on {index.device}")


def _check_gather(src: Tensor, index: Tensor) -> None:
    if src.ndim != 4:
        raise ValueError(f"src must be [B, M, H, D], got {tuple(src.shape)}")
    _check_index(src, index, "src")


def _check_scatter(dst: Tensor, index: Tensor, src: Tensor) -> None:
    if dst.ndim != 4 or src.ndim != 4:
        raise ValueError(f"dst and src must be [B, M, H, D] / [B, N, H, D], got {tuple(dst.shape)} / {tuple(src.shape)}")
    _check_index(dst, index, "dst")
    b, _, h, d = dst.shape
    if tuple(src.shape) != (b, index.shape[2], h, d) or src.dtype != dst.dtype:
        raise ValueError(f"src must be {dst.dtype} [B, N, H, D] = [{b}, {index.shape[2]}, {h}, {d}], "
                         f"got {src.dtype} {tuple(src.shape)}")
    if src.device != dst.device:
        raise ValueError(f"device mismatch: dst on {dst.device}, index on {index.device}, src on {src.device}")


def gather_rows_torch(src: Tensor, index: Tensor) -> Tensor:
    """Reference twin: ``torch.gather`` along rows with the index expanded over D."""
    _check_gather(src, index)
    idx = index.transpose(1, 2)[..., None].expand(-1, -1, -1, src.shape[3])
    return src.gather(1, idx).contiguous()


def scatter_rows_torch(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """Reference twin: ``scatter_`` along rows with the index expanded over D; returns ``dst``.
    ``src`` is copied first: it may be a view of other rows of ``dst``'s buffer (the open chunk)."""
    _check_scatter(dst, index, src)
    idx = index.transpose(1, 2)[..., None].expand(-1, -1, -1, dst.shape[3])
    return dst.scatter_(1, idx, src.clone())


if HAS_TRITON:

    @triton.jit
    def _move_rows(cache_ptr, index_ptr, rows_ptr, H, M, N,
                   stride_cb, stride_cm, stride_ch, stride_cd, stride_rb, stride_rn, stride_rh, stride_rd,
                   ROWS: tl.constexpr, D: tl.constexpr, SCATTER: tl.constexpr):
        """One program: ``ROWS`` positions of head ``program_id(1)`` = b * H + h. Position i is row i
        of the ordered side and row ``index[b, h, i]`` (clamped) of the cache; it moves cache ->
        ordered, or back with ``SCATTER``."""
        bh = tl.program_id(1)
        pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = pos < N
        idx = tl.load(index_ptr + bh.to(tl.int64) * N + pos, mask=ok, other=0)
        idx = tl.minimum(tl.maximum(idx, 0), M - 1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
        offs_d = tl.arange(0, D)
        cached = cache_ptr + b * stride_cb + h * stride_ch + idx[:, None] * stride_cm + offs_d[None, :] * stride_cd
        ordered = (rows_ptr + b * stride_rb + h * stride_rh + pos.to(tl.int64)[:, None] * stride_rn
                   + offs_d[None, :] * stride_rd)
        if SCATTER:
            tl.store(cached, tl.load(ordered, mask=ok[:, None]), mask=ok[:, None])
        else:
            tl.store(ordered, tl.load(cached, mask=ok[:, None]), mask=ok[:, None])

    # Two entry points of one body, so that a profile names the direction.
    @triton.jit(do_not_specialize=["H", "M", "N"])
    def _gather_rows_kernel(src_ptr, index_ptr, out_ptr, H, M, N,
                            stride_sb, stride_sm, stride_sh, stride_sd, stride_ob, stride_on, stride_oh, stride_od,
                            ROWS: tl.constexpr, D: tl.constexpr):
        _move_rows(src_ptr, index_ptr, out_ptr, H, M, N, stride_sb, stride_sm, stride_sh, stride_sd,
                   stride_ob, stride_on, stride_oh, stride_od, ROWS, D, False)

    @triton.jit(do_not_specialize=["H", "M", "N"])
    def _scatter_rows_kernel(dst_ptr, index_ptr, src_ptr, H, M, N,
                             stride_db, stride_dm, stride_dh, stride_dd, stride_sb, stride_sn, stride_sh, stride_sd,
                             ROWS: tl.constexpr, D: tl.constexpr):
        _move_rows(dst_ptr, index_ptr, src_ptr, H, M, N, stride_db, stride_dm, stride_dh, stride_dd,
                   stride_sb, stride_sn, stride_sh, stride_sd, ROWS, D, True)


def _move(kernel, cache: Tensor, index: Tensor, rows: Tensor) -> None:
    """Launch a direction's kernel on the cache ``[B, M, H, D]`` and ordered rows ``[B, N, H, D]``."""
    b, m, h, d = cache.shape
    n = index.shape[2]
    if n == 0 or b * h == 0:
        return
    if m == 0:
        raise ValueError("index into an empty cache region (M = 0)")
    kernel[(triton.cdiv(n, _ROWS), b * h)](cache, index.contiguous(), rows, h, m, n, *cache.stride(), *rows.stride(),
                                          ROWS=_ROWS, D=d, num_warps=4)


def gather_rows(src: Tensor, index: Tensor) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two)."""
    if not HAS_TRITON:
        raise RuntimeError("gather_rows needs triton, which is not importable")
    _check_gather(src, index)
    b, _, h, d = src.shape
    check_row_kernel(src, d)
    out = torch.empty(b, index.shape[2], h, d, dtype=src.dtype, device=src.device)
    if out.numel():
        _move(_gather_rows_kernel, src, index, out)
    return out


def scatter_rows(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two)."""
    if not HAS_TRITON:
        raise RuntimeError("scatter_rows needs triton, which is not importable")
    _check_scatter(dst, index, src)
    check_row_kernel(dst, dst.shape[3])
    _move(_scatter_rows_kernel, dst, index, src)
    return dst


def gather_rows_auto(src: Tensor, index: Tensor) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = src.shape[-1] if src.ndim == 4 else 0
    fn = gather_rows if use_kernel(src, power_of_two(d)) else gather_rows_torch
    return fn(src, index)


def scatter_rows_auto(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = dst.shape[-1] if dst.ndim == 4 else 0
    fn = scatter_rows if use_kernel(dst, power_of_two(d)) else scatter_rows_torch
    return fn(dst, index, src)
