"""Fused q/k RMS norm + 3-axis RoPE (the Wan self-attention prologue), as one Triton kernel.

Why: in eager PyTorch the norm and the rotation are eight elementwise kernels over an fp32
copy of q (and of k) in every layer; at 4680 tokens x 1536 channels that is ~60 launches and
~2 GB of fp32 traffic per forward for what is a single read and write of the bf16 row.

Semantics (the twin defines them): x ``[B, L, C]`` with ``C = H * D``; in fp32, each row
is RMS-normalised over all C channels and scaled by ``weight`` (``weight`` None: no norm),
then each head's adjacent channel pairs ``(2j, 2j+1)`` are rotated by ``freqs[l, j] =
(cos, sin)``. The result ``[B, L, H, D]`` is rounded once, to x's dtype.

Kernel layout: grid ``(B * L,)``, one program per token row, holding its even and odd
channels as two ``[H, D/2]`` fp32 tiles (heads padded to a power of two).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, triton_runs_on

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["qk_norm_rope", "qk_norm_rope_auto", "qk_norm_rope_torch"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def qk_norm_rope_torch(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Reference twin (and the fallback where Triton cannot run)."""
    d = _check(x, weight, freqs, num_heads)
    xf = x.float()
    if weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    xf = xf.unflatten(-1, (num_heads, d // 2, 2))
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["L"])
    def _qk_norm_rope_kernel(x_ptr, w_ptr, f_ptr, o_ptr, L, stride_xb, stride_xl, stride_xc, eps,
                             H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b, l = row // L, row % L
        offs_h = tl.arange(0, BLOCK_H)
        offs_j = tl.arange(0, HALF)
        ch = offs_h[:, None] * (2 * HALF) + 2 * offs_j[None, :]  # even channel of each pair
        ok = (offs_h < H)[:, None]
        x_row = x_ptr + b * stride_xb + l * stride_xl
        xe = tl.load(x_row + ch * stride_xc, mask=ok, other=0.0).to(tl.float32)
        xo = tl.load(x_row + (ch + 1) * stride_xc, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            ms = (tl.sum(tl.sum(xe * xe, 1), 0) + tl.sum(tl.sum(xo * xo, 1), 0)) / (H * 2 * HALF)
            r = 1.0 / tl.sqrt(ms + eps)
            xe = xe * r * tl.load(w_ptr + ch, mask=ok, other=0.0).to(tl.float32)
            xo = xo * r * tl.load(w_ptr + ch + 1, mask=ok, other=0.0).to(tl.float32)
        cos = tl.load(f_ptr + l * (2 * HALF) + 2 * offs_j)[None, :]
        sin = tl.load(f_ptr + l * (2 * HALF) + 2 * offs_j + 1)[None, :]
        o_row = o_ptr + row * (H * 2 * HALF)
        dtype = o_ptr.dtype.element_ty
        tl.store(o_row + ch, (xe * cos - xo * sin).to(dtype), mask=ok)
        tl.store(o_row + ch + 1, (xe * sin + xo * cos).to(dtype), mask=ok)


def qk_norm_rope(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Triton kernel with the twin's contract (x in bf16 / fp16 / fp32, D/2 a power of two)."""
    if not HAS_TRITON:
        raise RuntimeError("qk_norm_rope needs triton, which is not importable")
    d = _check(x, weight, freqs, num_heads)
    if x.dtype not in _DTYPES:
        raise ValueError(f"dtype {x.dtype} unsupported by the kernel (bf16/fp16/fp32)")
    if (d // 2) & (d // 2 - 1):
        raise ValueError(f"kernel needs head dim / 2 a power of two, got D={d}")
    if not triton_runs_on(x):
        raise ValueError(f"kernel needs CUDA tensors (or CPU with TRITON_INTERPRET=1), got device {x.device}")
    b, length, c = x.shape
    out = torch.empty(b, length, num_heads, d, dtype=x.dtype, device=x.device)
    if out.numel():
        _qk_norm_rope_kernel[(b * length,)](
            x, weight if weight is not None else x, freqs.contiguous(), out, length, *x.stride(), float(eps),
            H=num_heads, HALF=d // 2, BLOCK_H=triton.next_power_of_2(num_heads), HAS_NORM=weight is not None,
            num_warps=4)
    return out


def qk_norm_rope_auto(x: Tensor, weight: Tensor | None, freqs: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """The kernel on CUDA where the shapes suit it, else the twin. Not under the CPU interpreter:
    one program per token makes whole-model forwards there crawl (the tests call the kernel)."""
    d = x.shape[-1] // num_heads if num_heads else 0
    fits = x.dtype in _DTYPES and d >= 2 and not (d // 2) & (d // 2 - 1)
    fn = qk_norm_rope if HAS_TRITON and x.is_cuda and fits else qk_norm_rope_torch
    return fn(x, weight, freqs, num_heads, eps)
