"""Token rows at unit norm x 256 in fp8 e4m3, the operands of TempCache's fp8 match, as one Triton kernel.

Why: the shared match compares whole tokens (every head's key concatenated) by cosine on fp8
tensor cores. Torch needs separate passes over the history's keys for the per-head gather (lining
up an AnnSA-sorted history's heads), the norm, the scale and the cast; here a program reads its
rows (through the gather) once to sum their squares and again, from L2, to write them. The new
tokens' side takes the same kernel.

Semantics (the twin defines them): for ``src [M_src, H, D]`` (any strides) and optionally ``index
[H, M]`` int64 (row m of head h is ``src[index[h, m], h]``; without it ``src[m, h]``, M = M_src),
row m of the result is that token's H x D values in fp32, times ``256 / max(|row|, 1e-12)`` (0
where ``held[m]`` is False), rounded to e4m3: ``[m_out, H * D]`` fp8, rows from M on zero (fp8
GEMMs want row counts in multiples of 16). 256 keeps every entry of a unit vector inside e4m3's
448 and a spread-out one's (~256 / sqrt(H D)) in its normal range. The kernel clamps index values
(no host sync); the twin raises on them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["UNIT", "unit_fp8", "unit_fp8_auto", "unit_fp8_torch"]

UNIT = 256.0
_ROWS = 16  # tokens per program: 16 x 1536 bf16 = 48 KiB read twice (the second time from L2)


def _check(src: Tensor, index: Tensor | None, held: Tensor | None, m_out: int | None) -> tuple[int, int]:
    if src.ndim != 3:
        raise ValueError(f"src must be [M, H, D], got {tuple(src.shape)}")
    _, h, _ = src.shape
    m = src.shape[0]
    if index is not None:
        if index.dtype != torch.int64 or index.ndim != 2 or index.shape[0] != h:
            raise ValueError(f"index must be int64 [H={h}, M], got {index.dtype} {tuple(index.shape)}")
        m = index.shape[1]
    if held is not None and (held.dtype != torch.bool or tuple(held.shape) != (m,)):
        raise ValueError(f"held must be bool [M={m}], got {held.dtype} {tuple(held.shape)}")
    m_out = m if m_out is None else m_out
    if m_out < m:
        raise ValueError(f"m_out={m_out} must be >= M={m}")
    for name, t in (("index", index), ("held", held)):
        if t is not None and t.device != src.device:
            raise ValueError(f"device mismatch: src on {src.device}, {name} on {t.device}")
    return m, m_out


def unit_fp8_torch(src: Tensor, index: Tensor | None = None, held: Tensor | None = None,
                   m_out: int | None = None) -> Tensor:
    """Reference twin: ``[m_out, H * D]`` float8_e4m3fn."""
    m, m_out = _check(src, index, held, m_out)
    _, h, d = src.shape
    if index is not None:
        src = torch.stack([src[index[i], i] for i in range(h)], dim=1)  # [M, H, D]
    x = src.float().reshape(m, h * d)
    inv = UNIT / torch.linalg.vector_norm(x, dim=-1).clamp_min(1e-12)
    if held is not None:
        inv = torch.where(held, inv, 0.0)
    out = torch.zeros(m_out, h * d, dtype=torch.float8_e4m3fn, device=src.device)
    out[:m] = (x * inv[:, None]).to(torch.float8_e4m3fn)
    return out


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M", "M_src", "M_out"])
    def _unit_fp8_kernel(src_ptr, index_ptr, held_ptr, out_ptr, M, M_src, M_out,
                         stride_sm, stride_sh, stride_sd,
                         H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                         HAS_INDEX: tl.constexpr, HAS_HELD: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = rows < M
        offs_d = tl.arange(0, D)
        sq = tl.zeros([ROWS], dtype=tl.float32)
        for h in tl.static_range(H):
            if HAS_INDEX:
                src_rows = tl.load(index_ptr + h * M + rows.to(tl.int64), mask=ok, other=0)
                src_rows = tl.minimum(tl.maximum(src_rows, 0), M_src - 1)  # memory safety only
            else:
                src_rows = rows.to(tl.int64)
            x = tl.load(src_ptr + src_rows[:, None] * stride_sm + h * stride_sh + offs_d[None, :] * stride_sd,
                        mask=ok[:, None], other=0.0).to(tl.float32)
            sq += tl.sum(x * x, 1)
        inv = tl.math.div_rn(tl.full([ROWS], 256.0, tl.float32), tl.maximum(tl.sqrt_rn(sq), 1e-12))
        if HAS_HELD:
            inv = tl.where(tl.load(held_ptr + rows, mask=ok, other=0) != 0, inv, 0.0)
        inv = tl.where(ok, inv, 0.0)  # padding rows: zeros
        out_rows = rows.to(tl.int64) * (H * D)
        for h in tl.static_range(H):
            if HAS_INDEX:
                src_rows = tl.load(index_ptr + h * M + rows.to(tl.int64), mask=ok, other=0)
                src_rows = tl.minimum(tl.maximum(src_rows, 0), M_src - 1)
            else:
                src_rows = rows.to(tl.int64)
            x = tl.load(src_ptr + src_rows[:, None] * stride_sm + h * stride_sh + offs_d[None, :] * stride_sd,
                        mask=ok[:, None], other=0.0).to(tl.float32)
            tl.store(out_ptr + out_rows[:, None] + h * D + offs_d[None, :], (x * inv[:, None]).to(tl.float8e4nv),
                     mask=(rows < M_out)[:, None])


def unit_fp8(src: Tensor, index: Tensor | None = None, held: Tensor | None = None,
             m_out: int | None = None) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two)."""
    if not HAS_TRITON:
        raise RuntimeError("unit_fp8 needs triton, which is not importable")
    m, m_out = _check(src, index, held, m_out)
    m_src, h, d = src.shape
    check_row_kernel(src, d)
    out = torch.empty(m_out, h * d, dtype=torch.float8_e4m3fn, device=src.device)
    if out.numel() == 0:
        return out
    if m and m_src == 0:
        raise ValueError("index into an empty src (M_src = 0)")
    _unit_fp8_kernel[(triton.cdiv(m_out, _ROWS),)](
        src, index.contiguous() if index is not None else src,
        held.contiguous().view(torch.int8) if held is not None else src, out,
        m, max(m_src, 1), m_out, *src.stride(), H=h, D=d, ROWS=_ROWS,
        HAS_INDEX=index is not None, HAS_HELD=held is not None, num_warps=4)
    return out


def unit_fp8_auto(src: Tensor, index: Tensor | None = None, held: Tensor | None = None,
                  m_out: int | None = None) -> Tensor:
    """The kernel where Triton runs and D is a power of two, else the twin."""
    d = src.shape[-1] if src.ndim == 3 else 0
    fn = unit_fp8 if use_kernel(src, power_of_two(d)) else unit_fp8_torch
    return fn(src, index, held, m_out)
