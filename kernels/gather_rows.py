"""Per-head row gather of a ``[B, M, H, D]`` cache region, as one Triton kernel.

Why: AnnSA re-sorts every layer's history by bucket after each clean pass, and TempCache's
shared match aligns the heads of a sorted history by token; both move whole rows of one head
by an index per row. ``torch.gather`` needs that index expanded to every element (an int64 read
per bf16 element, five times the data moved); here a program reads one index per row and moves
the row's D contiguous values.

Semantics (the twin defines them): ``out[b, i, h] = src[b, index[b, h, i], h]`` for ``src
[B, M, H, D]`` (any strides; a cache slice is read in place) and ``index [B, H, N]`` int64 with
values in ``[0, M)``. Returns a new contiguous ``[B, N, H, D]`` tensor. The twin raises on an
index out of range; the kernel clamps it (no host sync), as the block-sparse kernel does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["gather_rows", "gather_rows_auto", "gather_rows_torch"]

_ROWS = 32  # rows per program: 32 x 128 bf16 = 8 KiB moved per program


def _check(src: Tensor, index: Tensor) -> None:
    if src.ndim != 4:
        raise ValueError(f"src must be [B, M, H, D], got {tuple(src.shape)}")
    b, _, h, _ = src.shape
    if index.dtype != torch.int64 or index.ndim != 3 or index.shape[:2] != (b, h):
        raise ValueError(f"index must be int64 [B={b}, H={h}, N], got {index.dtype} {tuple(index.shape)}")
    if index.device != src.device:
        raise ValueError(f"device mismatch: src on {src.device}, index on {index.device}")


def gather_rows_torch(src: Tensor, index: Tensor) -> Tensor:
    """Reference twin: ``torch.gather`` along rows with the index expanded over D."""
    _check(src, index)
    idx = index.transpose(1, 2)[..., None].expand(-1, -1, -1, src.shape[3])
    return src.gather(1, idx).contiguous()


if HAS_TRITON:

    @triton.jit
    def _indexed_rows(index_ptr, H, M, N, ROWS: tl.constexpr):
        """A program's share of a per-head row move: ``ROWS`` consecutive positions of one head
        ``program_id(1)`` = b * H + h, and the cache rows their index names, clamped into [0, M)
        for memory safety only. Returns (b, h, positions, in range, rows). Shared with the scatter."""
        bh = tl.program_id(1)
        pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = pos < N
        idx = tl.load(index_ptr + bh.to(tl.int64) * N + pos, mask=ok, other=0)
        return (bh // H).to(tl.int64), (bh % H).to(tl.int64), pos, ok, tl.minimum(tl.maximum(idx, 0), M - 1)

    @triton.jit(do_not_specialize=["H", "M", "N"])
    def _gather_rows_kernel(src_ptr, index_ptr, out_ptr, H, M, N,
                            stride_sb, stride_sm, stride_sh, stride_sd,
                            ROWS: tl.constexpr, D: tl.constexpr):
        """One program: ``ROWS`` consecutive output rows of one head."""
        b, h, rows, ok, src_rows = _indexed_rows(index_ptr, H, M, N, ROWS)
        offs_d = tl.arange(0, D)
        vals = tl.load(src_ptr + b * stride_sb + h * stride_sh + src_rows[:, None] * stride_sm
                       + offs_d[None, :] * stride_sd, mask=ok[:, None])
        dst = ((b * N + rows.to(tl.int64)) * H + h) * D
        tl.store(out_ptr + dst[:, None] + offs_d[None, :], vals, mask=ok[:, None])


def gather_rows(src: Tensor, index: Tensor) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two); grid ``(ceil(N / 32), B * H)``."""
    if not HAS_TRITON:
        raise RuntimeError("gather_rows needs triton, which is not importable")
    _check(src, index)
    b, m, h, d = src.shape
    check_row_kernel(src, d)
    n = index.shape[2]
    out = torch.empty(b, n, h, d, dtype=src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    if m == 0:
        raise ValueError("index into an empty src (M = 0)")
    _gather_rows_kernel[(triton.cdiv(n, _ROWS), b * h)](src, index.contiguous(), out, h, m, n, *src.stride(),
                                                        ROWS=_ROWS, D=d, num_warps=4)
    return out


def gather_rows_auto(src: Tensor, index: Tensor) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = src.shape[-1] if src.ndim == 4 else 0
    fn = gather_rows if use_kernel(src, power_of_two(d)) else gather_rows_torch
    return fn(src, index)
