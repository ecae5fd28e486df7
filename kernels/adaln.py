"""Residual update + LayerNorm + modulation (the Wan block's adaLN), as one Triton kernel.

Why: eager PyTorch runs a gated residual, a LayerNorm and a modulation as separate kernels, each a
pass over the chunk's rows; one pass does the same work.

Semantics (the twin defines them): x ``[B, F, S, C]`` (tokens grouped by frame); the residual
``r = x + y * gate`` (``x + y`` without gate, ``x`` without y) in fp32, rounded to x's dtype as the
residual stream is kept; then, in fp32 from that rounded r, ``h = LayerNorm(r) * (1 + scale) +
shift`` (``one_plus``: Wan's modulation) or ``LayerNorm(r) * scale + shift`` (an affine
LayerNorm), rounded once. gate / scale / shift are per frame ``[B, T, C]`` (T in {1, F}) or per
channel ``[C]``. Returns ``(r, h)``.

Kernel layout: ROWS token rows per program as one ``[ROWS, C]`` fp32 tile (C padded to a power of
two); each row's frame picks its gate / scale / shift row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["adaln", "adaln_auto", "adaln_torch"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS = 4


def _per_frame(t: Tensor | None, name: str, x: Tensor) -> Tensor | None:
    """gate / scale / shift as [B, T, C] (a [C] vector broadcast over batch and frames)."""
    if t is None:
        return None
    b, f, _, c = x.shape
    if t.ndim == 1:
        t = t.view(1, 1, c) if t.shape[0] == c else t
    if t.ndim != 3 or t.shape[-1] != c or t.shape[0] not in (1, b) or t.shape[1] not in (1, f):
        raise ValueError(f"{name} must be [C={c}] or [B={b}, T, C={c}] with T in (1, {f}), got {tuple(t.shape)}")
    return t


def _check(x: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor, shift: Tensor):
    if x.ndim != 4:
        raise ValueError(f"x must be [B, F, S, C], got shape {tuple(x.shape)}")
    if y is not None and y.shape != x.shape:
        raise ValueError(f"y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    if gate is not None and y is None:
        raise ValueError("gate given without y")
    return _per_frame(gate, "gate", x), _per_frame(scale, "scale", x), _per_frame(shift, "shift", x)


def adaln_torch(x: Tensor, scale: Tensor, shift: Tensor, *, y: Tensor | None = None, gate: Tensor | None = None,
                one_plus: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Reference twin (and the fallback where Triton cannot run)."""
    gate, scale, shift = _check(x, y, gate, scale, shift)
    r = x
    if y is not None:
        r = (x.float() + y.float() * (gate.float().unsqueeze(2) if gate is not None else 1.0)).to(x.dtype)
    n = torch.nn.functional.layer_norm(r.float(), (r.shape[-1],), eps=eps)
    a = scale.float().unsqueeze(2) + (1.0 if one_plus else 0.0)
    return r, (n * a + shift.float().unsqueeze(2)).to(x.dtype)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["n_rows", "S", "F"])
    def _adaln_kernel(x_ptr, y_ptr, g_ptr, a_ptr, b_ptr, r_ptr, h_ptr, n_rows, S, F, C, eps,
                      g_sb, g_st, a_sb, a_st, b_sb, b_st,
                      ROWS: tl.constexpr, BLOCK_C: tl.constexpr, HAS_Y: tl.constexpr, HAS_GATE: tl.constexpr,
                      ONE_PLUS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        ok = (rows < n_rows)[:, None] & (cols < C)[None, :]
        offs = rows[:, None] * C + cols[None, :]
        frame = rows // S
        b, t = frame // F, frame % F
        dtype = x_ptr.dtype.element_ty
        r = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_GATE:
                y = y * tl.load(g_ptr + (b * g_sb + t * g_st)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            r = (r + y).to(dtype)
            tl.store(r_ptr + offs, r, mask=ok)
            r = r.to(tl.float32)
        mean = tl.sum(r, 1) / C
        d = tl.where(ok, r - mean[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(d * d, 1) / C + eps)
        a = tl.load(a_ptr + (b * a_sb + t * a_st)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if ONE_PLUS:
            a = a + 1.0
        sh = tl.load(b_ptr + (b * b_sb + t * b_st)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, (d * inv[:, None] * a + sh).to(dtype), mask=ok)


def _strides(t: Tensor) -> tuple[int, int]:
    """(batch, frame) strides of a [B, T, C] operand; 0 where it broadcasts."""
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def adaln(x: Tensor, scale: Tensor, shift: Tensor, *, y: Tensor | None = None, gate: Tensor | None = None,
          one_plus: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract (bf16 / fp16 / fp32)."""
    if not HAS_TRITON:
        raise RuntimeError("adaln needs triton, which is not importable")
    gate, scale, shift = _check(x, y, gate, scale, shift)
    if x.dtype not in _DTYPES:
        raise ValueError(f"dtype {x.dtype} unsupported by the kernel (bf16/fp16/fp32)")
    check_triton_runs_on(x)
    b, f, s, c = x.shape
    x = x.contiguous()
    y = y.contiguous() if y is not None else None
    gate, scale, shift = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (gate, scale, shift))
    r = torch.empty_like(x) if y is not None else x
    h = torch.empty_like(x)
    n_rows = b * f * s
    if n_rows:
        g = gate if gate is not None else scale
        block_c = triton.next_power_of_2(c)
        _adaln_kernel[(triton.cdiv(n_rows, ROWS),)](
            x, y if y is not None else x, g, scale, shift, r, h, n_rows, s, f, c, float(eps),
            *_strides(g), *_strides(scale), *_strides(shift),
            ROWS=ROWS, BLOCK_C=block_c, HAS_Y=y is not None, HAS_GATE=gate is not None, ONE_PLUS=one_plus,
            num_warps=8 if block_c >= 2048 else 4)
    return r, h


def adaln_auto(x: Tensor, scale: Tensor, shift: Tensor, *, y: Tensor | None = None, gate: Tensor | None = None,
               one_plus: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The kernel on CUDA for the dtypes it takes, else the twin (never interpreted)."""
    fn = adaln if use_kernel(x, x.dtype in _DTYPES, interpreted=False) else adaln_torch
    return fn(x, scale, shift, y=y, gate=gate, one_plus=one_plus, eps=eps)
