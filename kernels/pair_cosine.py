"""Cosine of each new token with its matched history token, all heads concatenated, as one Triton kernel.

Why: TempCache's shared match picks each new token's counterpart on fp8 scores, and whether the
pair merges is decided on the exact cosine of their keys. Torch needs a per-head gather and
upcast copies; here a program reads its tokens' rows once and keeps three fp32 sums.

Semantics (the twin defines them): for ``x [N, H, D]``, ``src [M, H, D]`` (any strides) and ``rows
[H, N]`` int64 in ``[0, M)``, with ``y[n, h] = src[rows[h, n], h]``: ``cos[n] = <x[n], y[n]> /
max(|x[n]| |y[n]|, 1e-12)`` over all H x D entries, in fp32. The kernel clamps row indices into
range (no host sync); the twin raises on them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["pair_cosine", "pair_cosine_auto", "pair_cosine_torch"]

_ROWS = 16  # tokens per program: 16 x 1536 x 2 bf16 = 96 KiB read


def _check(x: Tensor, src: Tensor, rows: Tensor) -> None:
    if x.ndim != 3 or src.ndim != 3 or x.shape[1:] != src.shape[1:]:
        raise ValueError(f"x and src must be [N, H, D] / [M, H, D], got {tuple(x.shape)} / {tuple(src.shape)}")
    n, h, _ = x.shape
    if rows.dtype != torch.int64 or tuple(rows.shape) != (h, n):
        raise ValueError(f"rows must be int64 [H={h}, N={n}], got {rows.dtype} {tuple(rows.shape)}")
    if not x.device == src.device == rows.device:
        raise ValueError(f"device mismatch: x on {x.device}, src on {src.device}, rows on {rows.device}")


def pair_cosine_torch(x: Tensor, src: Tensor, rows: Tensor) -> Tensor:
    """Reference twin: fp32 ``[N]``."""
    _check(x, src, rows)
    n, h, d = x.shape
    y = torch.stack([src[rows[i], i] for i in range(h)], dim=1).float().reshape(n, h * d)
    x = x.float().reshape(n, h * d)
    norms = torch.linalg.vector_norm(x, dim=-1) * torch.linalg.vector_norm(y, dim=-1)
    return (x * y).sum(-1) / norms.clamp_min(1e-12)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["N", "M"])
    def _pair_cosine_kernel(x_ptr, src_ptr, rows_ptr, out_ptr, N, M,
                            stride_xn, stride_xh, stride_xd, stride_sm, stride_sh, stride_sd,
                            H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
        tok = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = tok < N
        offs_d = tl.arange(0, D)
        xy = tl.zeros([ROWS], dtype=tl.float32)
        xx = tl.zeros([ROWS], dtype=tl.float32)
        yy = tl.zeros([ROWS], dtype=tl.float32)
        for h in tl.static_range(H):
            r = tl.load(rows_ptr + h * N + tok, mask=ok, other=0)
            r = tl.minimum(tl.maximum(r, 0), M - 1)  # memory safety only
            x = tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_xn + h * stride_xh + offs_d[None, :] * stride_xd,
                        mask=ok[:, None], other=0.0).to(tl.float32)
            y = tl.load(src_ptr + r[:, None] * stride_sm + h * stride_sh + offs_d[None, :] * stride_sd,
                        mask=ok[:, None], other=0.0).to(tl.float32)
            xy += tl.sum(x * y, 1)
            xx += tl.sum(x * x, 1)
            yy += tl.sum(y * y, 1)
        cos = xy / tl.maximum(tl.sqrt_rn(xx) * tl.sqrt_rn(yy), 1e-12)
        tl.store(out_ptr + tok, cos, mask=ok)


def pair_cosine(x: Tensor, src: Tensor, rows: Tensor) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two); grid ``ceil(N / 16)``."""
    if not HAS_TRITON:
        raise RuntimeError("pair_cosine needs triton, which is not importable")
    _check(x, src, rows)
    n, h, d = x.shape
    check_row_kernel(x, d)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0 or h == 0:
        return out
    if src.shape[0] == 0:
        raise ValueError("rows into an empty src (M = 0)")
    _pair_cosine_kernel[(triton.cdiv(n, _ROWS),)](x, src, rows.contiguous(), out, n, src.shape[0],
                                                  *x.stride(), *src.stride(), H=h, D=d, ROWS=_ROWS, num_warps=4)
    return out


def pair_cosine_auto(x: Tensor, src: Tensor, rows: Tensor) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = x.shape[-1] if x.ndim == 3 else 0
    fn = pair_cosine if use_kernel(x, power_of_two(d)) else pair_cosine_torch
    return fn(x, src, rows)
