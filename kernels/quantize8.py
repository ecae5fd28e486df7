"""Attention inputs in 8 bits with their scales, for the block-sparse kernel's 8-bit path: queries and
keys in int8 per token, values in float8 e4m3 per channel.

Why int8 for the logits: q.k sums D products, and int8's even steps (1/254 of a row's largest
value) err ~5x less on them than e4m3's 3 mantissa bits at the same tensor-core rate (bench/NOTES.md,
"8-bit attention"). Why per token: a plan's ranges start anywhere, so a key's scale must be its own.
Values per channel: the P.V product takes one scale per output channel for free (it multiplies the
result), and they are written transposed ([B, H, D, L'] storage), the layout Hopper's 8-bit tensor
cores read the product's right operand in.

Semantics (the twin defines them): for x ``[B, L, H, D]`` (any strides),

- ``per="token"``: ``scale[b, h, l] = max(amax_d |x[b, l, h, :]|, 1e-12) / 127`` and
  ``x8 = round(x / scale)`` in int8 (half away from zero), contiguous ``[B, L, H, D]``;
- ``per="channel"``: ``scale[b, h, d] = max(amax_l |x[b, :, h, d]|, 1e-12) / 448`` and
  ``x8 = e4m3(x / scale)`` (nearest, saturated at +-448), a ``[B, L, H, D]`` view of ``[B, H, D,
  L']`` storage, L' = L rounded up to 16.

Returns ``(x8, scale)``, scale fp32 contiguous. Triton's interpreter rounds float-to-e4m3 wrongly
at binade edges (7.99 becomes 4), so off-GPU the dispatcher runs the twin for values.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_row_kernel, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["quantize8", "quantize8_auto", "quantize8_torch"]

E4M3_MAX = 448.0
INT8_MAX = 127.0
_FLOOR = 1e-12
_BLOCK_L = 64


def _check(x: Tensor, per: str) -> None:
    if not isinstance(x, Tensor) or x.ndim != 4:
        raise ValueError(f"x must be a [B, L, H, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if per not in ("token", "channel"):
        raise ValueError(f"per must be 'token' or 'channel', got {per!r}")


def _channel_scale(x: Tensor) -> Tensor:
    return (x.abs().amax(1).float().clamp_min(_FLOOR) / E4M3_MAX).contiguous()  # [B, H, D]


def _transposed_out(x: Tensor) -> Tensor:
    b, n, h, d = x.shape
    storage = torch.empty(b, h, d, -(-n // 16) * 16, dtype=torch.float8_e4m3fn, device=x.device)
    return storage[..., :n].permute(0, 3, 1, 2)


def quantize8_torch(x: Tensor, per: str = "token") -> tuple[Tensor, Tensor]:
    """Reference twin (module docstring)."""
    _check(x, per)
    if per == "token":
        scale = (x.abs().amax(-1).float().clamp_min(_FLOOR) / INT8_MAX).transpose(1, 2).contiguous()
        y = x.float() / scale.transpose(1, 2)[..., None]
        out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        out.copy_((y.abs() + 0.5).floor().clamp(max=INT8_MAX).copysign(y))
    else:
        scale = _channel_scale(x)
        out = _transposed_out(x)
        out.copy_((x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
    return out, scale


if HAS_TRITON:

    @triton.jit(do_not_specialize=["L", "H"])
    def _quantize8_kernel(x_ptr, out_ptr, scale_ptr, L, H, sxb, sxl, sxh, sxd, sob, sol, soh, sod,
                             D: tl.constexpr, BLOCK_L: tl.constexpr, PER_CHANNEL: tl.constexpr):
        """One program: BLOCK_L tokens of one (b, h)."""
        pid_l, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
        offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_d = tl.arange(0, D)
        ok = (offs_l < L)[:, None]
        l64 = offs_l.to(tl.int64)[:, None]
        x = tl.load(x_ptr + b * sxb + h * sxh + l64 * sxl + offs_d[None, :] * sxd, mask=ok, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + b * sob + h * soh + l64 * sol + offs_d[None, :] * sod
        if PER_CHANNEL:  # e4m3; the scales are given (a reduction over all tokens)
            y = x / tl.load(scale_ptr + bh.to(tl.int64) * D + offs_d)[None, :]
            tl.store(out_ptrs, tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv), mask=ok)
        else:  # int8
            scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 127.0
            tl.store(scale_ptr + bh.to(tl.int64) * L + offs_l, scale, mask=offs_l < L)
            y = x / scale[:, None]
            r = tl.minimum(tl.floor(tl.abs(y) + 0.5), 127.0)
            tl.store(out_ptrs, tl.where(y < 0, -r, r).to(tl.int8), mask=ok)


def quantize8(x: Tensor, per: str = "token") -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract; grid (token blocks, B * H). Per channel, the scales'
    reduction over tokens is torch's."""
    if not HAS_TRITON:
        raise RuntimeError("quantize8 needs triton, which is not importable")
    _check(x, per)
    b, n, h, d = x.shape
    check_row_kernel(x, d)
    if per == "token":
        out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        scale = torch.empty(b, h, n, dtype=torch.float32, device=x.device)
    else:
        out, scale = _transposed_out(x), _channel_scale(x)
    if out.numel():
        _quantize8_kernel[(triton.cdiv(n, _BLOCK_L), b * h)](
            x, out, scale, n, h, *x.stride(), *out.stride(), D=d, BLOCK_L=_BLOCK_L, PER_CHANNEL=per == "channel",
            num_warps=4)
    return out, scale


def quantize8_auto(x: Tensor, per: str = "token") -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs and D is a power of two (values: on a GPU, see above), else the twin."""
    fits = isinstance(x, Tensor) and x.ndim == 4 and x.shape[-1] >= 1 and not x.shape[-1] & (x.shape[-1] - 1)
    return (quantize8 if use_kernel(x, fits, interpreted=per == "token") else quantize8_torch)(x, per)
