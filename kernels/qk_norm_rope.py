"""Fused q/k RMS norm + 3-axis RoPE (the Wan self-attention prologue), as one Triton kernel.

Why: eager PyTorch runs the norm and the rotation as several elementwise kernels over an fp32
copy of q (and k) in every layer, for what is one read and one write of each row.

Semantics (the twin defines them): x ``[B, L, C]`` with ``C = H * D``; in fp32, each row is
RMS-normalised over all C channels and scaled by ``weight`` (None: no norm), then each head's
channel pairs ``(2j, 2j+1)`` are rotated by ``freqs[l, j] = (cos, sin)``. The result ``[B, L, H,
D]`` is rounded once to x's dtype and written to ``out`` where given: the KV cache's rows of the
open chunk, so that k needs no copy into the cache.

Kernel layout: ROWS token rows per program, read and written as one contiguous ``[ROWS, C]`` tile
(C padded to a power of two), split into even and odd channels in registers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["qk_norm_rope", "qk_norm_rope_auto", "qk_norm_rope_torch"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS = 4


def _check(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int) -> int:
    """Shape checks; returns the head dim."""
    if x.ndim != 3:
        raise ValueError(f"x must be [B, L, C], got shape {tuple(x.shape)}")
    b, length, c = x.shape
    if num_heads < 1 or c % num_heads or (c // num_heads) % 2:
        raise ValueError(f"C={c} must split into num_heads={num_heads} heads of even size")
    d = c // num_heads
    if weight is not None and tuple(weight.shape) != (c,):
        raise ValueError(f"weight must be [C={c}], got {tuple(weight.shape)}")
    if tuple(freqs.shape) != (length, d // 2, 2) or freqs.dtype != torch.float32:
        raise ValueError(f"freqs must be float32 [L={length}, D/2={d // 2}, 2], got {freqs.dtype} {tuple(freqs.shape)}")
    return d


def _check_out(out: Tensor | None, x: Tensor, num_heads: int, d: int) -> None:
    """``out``: where the result goes (e.g. the KV cache's rows), [B, L, H, D] in x's dtype with each
    head's D channels contiguous (heads may lie further apart: TempCache's folded keys)."""
    if out is None:
        return
    want = (x.shape[0], x.shape[1], num_heads, d)
    if tuple(out.shape) != want or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {x.dtype} {list(want)} on {x.device}, got {out.dtype} {list(out.shape)} "
                         f"on {out.device}")
    if out.stride(3) != 1 or out.stride(2) < d:
        raise ValueError(f"out's channels must be contiguous and its heads apart, got strides {out.stride()}")


def qk_norm_rope_torch(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6,
                       out: Tensor | None = None) -> Tensor:
    """Reference twin (and the fallback where Triton cannot run)."""
    d = _check(x, weight, freqs, num_heads)
    _check_out(out, x, num_heads, d)
    xf = x.float()
    if weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    xf = xf.unflatten(-1, (num_heads, d // 2, 2))
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)
    return y if out is None else out.copy_(y)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["n_rows", "L"])
    def _qk_norm_rope_kernel(x_ptr, w_ptr, f_ptr, o_ptr, n_rows, L, stride_xb, stride_xl, stride_ob, stride_ol,
                             stride_oh, eps,
                             C: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                             HAS_NORM: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        b, l = rows // L, rows % L
        cols = tl.arange(0, BLOCK_C)
        ok = (rows < n_rows)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + (b * stride_xb + l * stride_xl)[:, None] + cols[None, :], mask=ok, other=0.0)
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), (ROWS, BLOCK_C // 2, 2)))  # channel pairs
        if HAS_NORM:
            r = 1.0 / tl.sqrt((tl.sum(xe * xe, 1) + tl.sum(xo * xo, 1)) / C + eps)
            we, wo = tl.split(tl.reshape(tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32),
                                         (BLOCK_C // 2, 2)))
            xe = xe * r[:, None] * we[None, :]
            xo = xo * r[:, None] * wo[None, :]
        pair = tl.arange(0, BLOCK_C // 2)
        ok_pair = (rows < n_rows)[:, None] & (pair < C // 2)[None, :]
        f_row = f_ptr + (l * (2 * HALF))[:, None] + 2 * (pair % HALF)[None, :]
        cos = tl.load(f_row, mask=ok_pair, other=0.0)
        sin = tl.load(f_row + 1, mask=ok_pair, other=0.0)
        out = tl.reshape(tl.join(xe * cos - xo * sin, xe * sin + xo * cos), (ROWS, BLOCK_C))
        out_cols = cols // (2 * HALF) * stride_oh + cols % (2 * HALF)
        tl.store(o_ptr + (b * stride_ob + l * stride_ol)[:, None] + out_cols[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=ok)


def qk_norm_rope(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6,
                 out: Tensor | None = None) -> Tensor:
    """Triton kernel with the twin's contract (x in bf16 / fp16 / fp32)."""
    if not HAS_TRITON:
        raise RuntimeError("qk_norm_rope needs triton, which is not importable")
    d = _check(x, weight, freqs, num_heads)
    if x.dtype not in _DTYPES:
        raise ValueError(f"dtype {x.dtype} unsupported by the kernel (bf16/fp16/fp32)")
    check_triton_runs_on(x)
    _check_out(out, x, num_heads, d)
    b, length, c = x.shape
    if out is None:
        out = torch.empty(b, length, num_heads, d, dtype=x.dtype, device=x.device)
    if out.numel():
        if x.stride(2) != 1:
            x = x.contiguous()
        _qk_norm_rope_kernel[(triton.cdiv(b * length, ROWS),)](
            x, weight if weight is not None else x, freqs.contiguous(), out, b * length, length, x.stride(0),
            x.stride(1), out.stride(0), out.stride(1), out.stride(2), float(eps), C=c, HALF=d // 2,
            BLOCK_C=triton.next_power_of_2(c), ROWS=ROWS,
            HAS_NORM=weight is not None, num_warps=8 if c >= 1024 else 4)
    return out


def qk_norm_rope_auto(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6,
                      out: Tensor | None = None) -> Tensor:
    """The kernel on CUDA for the dtypes it takes, else the twin (never interpreted)."""
    fn = qk_norm_rope if use_kernel(x, x.dtype in _DTYPES, interpreted=False) else qk_norm_rope_torch
    return fn(x, weight, freqs, num_heads, eps, out=out)
