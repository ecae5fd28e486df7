"""Linear layers on fp8 tensor cores: per-token scaled e4m3 activations times per-channel scaled e4m3
weights (``torch._scaled_mm``), with the activations quantized by one Triton kernel.

Why: Hopper multiplies e4m3 matrices at twice the bf16 rate, and the Wan blocks' linear layers are
the part of a chunk no attention trick removes. A scale per token row and one per output channel
keep e4m3's 3 mantissa bits relative to each row's own range (outlier tokens and channels do not
flatten the rest); both scales apply in the GEMM's epilogue, so the product is the exact sum over
the quantized operands in fp32, rounded once to the output dtype. The activations are quantized on
the fly (a read of the bf16 rows, a write of half as many bytes); the FFN's tanh GELU is applied in
the same pass (``gelu=True``), so its hidden activation goes from the first GEMM's bf16 output to
the second GEMM's fp8 input without a bf16 round trip.

Semantics (the twins define them):

- ``quantize_rows(x, gelu=False)``: x ``[M, K]`` (bf16 / fp16 / fp32, last dim contiguous); in
  fp32, ``h = gelu_tanh(x)`` (tanh GELU; or ``x``), ``scale = max(amax(|h_row|), 1e-12) / 448`` (IEEE
  division; the floor keeps zero rows finite: they quantize to zeros), ``x8 = e4m3(clamp(h /
  scale, -448, 448))`` rounded to nearest even. Returns ``(x8 [M, K] float8_e4m3fn, scale [M, 1]
  fp32)``: ``x8 * scale`` is h to within half an e4m3 step of the row's scale.
- ``fp8_matmul(x8, x_scale, weight8, weight_scale, bias, out_dtype=)``: ``(x8 @ weight8.T) * x_scale
  * weight_scale + bias`` in fp32 (weight8 ``[N, K]`` row-major, as nn.Linear stores its weight;
  weight_scale ``[1, N]``), rounded once to ``out_dtype``; written to ``out`` ``[M, N]`` where given.
- ``fp8_linear(x, weight8, weight_scale, bias, gelu_input=, out=)``: x ``[..., K]`` -> ``[..., N]`` in
  x's dtype: ``quantize_rows`` of x's rows (through the GELU with ``gelu_input``), then
  ``fp8_matmul``.
- ``quantize_weight(w)``: ``[N, K]`` -> ``(w8, scale [1, N])``, a scale per output channel as
  ``quantize_rows`` makes one per row. An e4m3 weight is taken as it is (no copy), with scale 1 or
  a given one: ComfyUI's fp8_e4m3fn checkpoints store Wan's weights that way, unscaled.

``fp8_matmul`` is ``torch._scaled_mm`` (rowwise scaling: compute capability 8.9 on, K and N
multiples of 16, bf16 / fp16 outputs; the weight passed as ``weight8.t()``, the column-major
operand cuBLASLt wants, with no copy); its twin multiplies the fp8 values in fp32, whose products
of e4m3 values lose nothing to TF32 either.

Kernel layout (``quantize_rows``): ROWS rows per program. Rows of up to 2048 channels are one
``[ROWS, K]`` register tile, read once; longer rows (the FFN's hidden 8960 / 13824) are read twice in
1024-channel slices, for the row maximum, then (from L2) to quantize. The rounding to e4m3 is done
on the fp32 bits (``_round_e4m3``), so the kernel equals the twin bit for bit, interpreted too.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["E4M3_MAX", "fp8_linear", "fp8_linear_auto", "fp8_linear_torch", "fp8_matmul", "fp8_matmul_auto",
           "fp8_matmul_torch", "gelu_tanh", "quantize_rows", "quantize_rows_auto", "quantize_rows_torch",
           "quantize_weight", "scaled_mm_runs"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MM_OUT_DTYPES = (torch.bfloat16, torch.float16)  # the outputs fp8_matmul computes (fp32: the twin)
_ONE_PASS_K = 2048  # rows up to this many channels (padded to a power of two) stay in registers
_SLICE_K = 1024     # channel slice of the two-pass layout
_TILE = 8192        # fp32 elements of a program's tile: ROWS = _TILE // padded K


# -- quantize_rows ---------------------------------------------------------------------------------
def _check_rows(x: Tensor) -> None:
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [M, K] with K >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be bf16 / fp16 / fp32, got {x.dtype}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"x's last dim must be contiguous, got strides {x.stride()}")


def gelu_tanh(h: Tensor) -> Tensor:
    """Tanh GELU in the kernel's form: ``h * sigmoid(2u) = 0.5 h (1 + tanh u)``, ``u = sqrt(2/pi) (h +
    0.044715 h^3)``. Unlike ``1 + tanh u`` it loses no bits where tanh u nears -1 (torch's form is off
    by ~1% at h = -4), and never gives NaN (exp's argument capped below fp32's overflow)."""
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    return h / (1.0 + torch.exp((-2.0 * u).clamp_max(80.0)))


def quantize_rows_torch(x: Tensor, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """Reference twin: ``(x8 [M, K] e4m3, scale [M, 1] fp32)``."""
    _check_rows(x)
    h = x.float()
    if gelu:
        h = gelu_tanh(h)
    amax = h.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR)
    # a tensor divisor: CUDA torch divides by a Python number as a product with its reciprocal, a last
    # bit off IEEE division on some rows, and a scale one bit off moves values that sit on a rounding edge
    scale = amax / torch.full_like(amax, E4M3_MAX)
    return (h / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


if HAS_TRITON:

    @triton.jit
    def _activation(x, GELU: tl.constexpr):
        """x in fp32, through tanh GELU where asked (``gelu_tanh``'s form)."""
        if GELU:
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
        return x

    @triton.jit
    def _round_e4m3(q):
        """q (fp32, |q| <= 448) rounded to nearest even on e4m3's grid, in fp32: 3 of the 23 mantissa
        bits kept (the carry may step the exponent), or multiples of 2^-9 below 2^-6 (the subnormals,
        by adding and taking away 1.5 * 2^14, whose fp32 ulp is 2^-9; the sign bit kept, as -0's).
        The cast to e4m3 after it is exact: Triton's CPU interpreter rounds that cast without carrying
        into the exponent."""
        bits = q.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
        sub = (tl.abs(q) + 24576.0) - 24576.0
        # q's sign bit set on the subnormal, not ``-sub``: negation compiles as 0 - sub, which
        # makes -0 of a negative q that rounds to zero +0
        sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(q) < 0.015625, sub, normal)

    @triton.jit
    def _quantize(x, scale, q_ptrs, ok):
        q = tl.math.div_rn(x, scale[:, None])
        q = _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        tl.store(q_ptrs, q.to(tl.float8e4nv), mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm,
                              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                              GELU: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        cols = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * stride_xm
        q_rows = q_ptr + rows[:, None] * K
        if ONE_PASS:
            ok = row_ok[:, None] & (cols < K)[None, :]
            x = _activation(tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32), GELU)
            amax = tl.max(tl.abs(x), 1)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([ROWS], 448.0, tl.float32))
            _quantize(x, scale, q_rows + cols[None, :], ok)
        else:
            amax = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ok = row_ok[:, None] & (k0 + cols < K)[None, :]
                x = _activation(tl.load(x_rows + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32), GELU)
                amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([ROWS], 448.0, tl.float32))
            for k0 in range(0, K, BLOCK_K):
                ok = row_ok[:, None] & (k0 + cols < K)[None, :]
                x = _activation(tl.load(x_rows + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32), GELU)
                _quantize(x, scale, q_rows + k0 + cols[None, :], ok)
        tl.store(s_ptr + rows, scale, mask=row_ok)


def quantize_rows(x: Tensor, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract."""
    if not HAS_TRITON:
        raise RuntimeError("quantize_rows needs triton, which is not importable")
    _check_rows(x)
    check_triton_runs_on(x)
    m, k = x.shape
    x8 = torch.empty(m, k, dtype=E4M3, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        one_pass = triton.next_power_of_2(k) <= _ONE_PASS_K
        block_k = triton.next_power_of_2(k) if one_pass else _SLICE_K
        rows = min(16, _TILE // block_k)
        _quantize_rows_kernel[(triton.cdiv(m, rows),)](
            x, x8, scale, m, k, x.stride(0), ROWS=rows, BLOCK_K=block_k, ONE_PASS=one_pass, GELU=gelu,
            num_warps=8 if rows * block_k >= _TILE else 4)
    return x8, scale


def quantize_rows_auto(x: Tensor, gelu: bool = False) -> tuple[Tensor, Tensor]:
    """The kernel on CUDA, else the twin (never interpreted: every forward of an fp8 model calls it)."""
    fits = x.ndim == 2 and x.dtype in _DTYPES and (x.stride(-1) == 1 or x.shape[-1] <= 1)
    fn = quantize_rows if use_kernel(x, fits, interpreted=False) else quantize_rows_torch
    return fn(x, gelu)


# -- fp8_matmul ------------------------------------------------------------------------------------
def _check_mm(x8: Tensor, x_scale: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None,
              out_dtype: torch.dtype, out: Tensor | None) -> tuple[int, int, int]:
    if x8.ndim != 2 or weight8.ndim != 2 or x8.shape[1] != weight8.shape[1]:
        raise ValueError(f"x8 must be [M, K] and weight8 [N, K], got {tuple(x8.shape)} and {tuple(weight8.shape)}")
    if x8.dtype != E4M3 or weight8.dtype != E4M3:
        raise ValueError(f"x8 and weight8 must be float8_e4m3fn, got {x8.dtype} and {weight8.dtype}")
    (m, k), n = x8.shape, weight8.shape[0]
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (m, 1):
        raise ValueError(f"x_scale must be fp32 [M={m}, 1], got {x_scale.dtype} {tuple(x_scale.shape)}")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (1, n):
        raise ValueError(f"weight_scale must be fp32 [1, N={n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {out_dtype} [M={m}, N={n}], got {out.dtype} {tuple(out.shape)}")
    return m, k, n


def fp8_matmul_torch(x8: Tensor, x_scale: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None,
                     *, out_dtype: torch.dtype, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """Reference twin: the fp8 values multiplied in fp32 (``use_fast_accum`` is the GPU's business)."""
    _check_mm(x8, x_scale, weight8, weight_scale, bias, out_dtype, out)
    y = (x8.float() @ weight8.float().t()) * x_scale * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype) if out is None else out.copy_(y)


def fp8_matmul(x8: Tensor, x_scale: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None,
               *, out_dtype: torch.dtype, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm`` with the twin's contract, for K and N multiples of 16 and a bf16 / fp16
    output (the GPU takes no bias with an fp32 one). ``use_fast_accum``: Hopper's faster fp8
    accumulation, which keeps fewer bits of long sums (off in the model)."""
    _, k, n = _check_mm(x8, x_scale, weight8, weight_scale, bias, out_dtype, out)
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got K={k}, N={n}")
    if out_dtype not in _MM_OUT_DTYPES:
        raise ValueError(f"fp8_matmul computes bf16 / fp16 outputs, got {out_dtype} (the twin computes any)")
    kw = dict(scale_a=x_scale, scale_b=weight_scale, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
              bias=None if bias is None else bias.to(out_dtype))  # _scaled_mm takes the output's dtype
    return torch._scaled_mm(x8, weight8.t(), **kw) if out is None else torch._scaled_mm(x8, weight8.t(), out=out, **kw)


@functools.lru_cache(maxsize=None)
def _fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_runs(x8: Tensor, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether ``fp8_matmul_auto`` takes ``torch._scaled_mm``: CUDA with fp8 tensor cores (compute
    capability 8.9 on), K and N multiples of 16, a bf16 / fp16 output."""
    return (x8.is_cuda and out_dtype in _MM_OUT_DTYPES and not k % 16 and not n % 16
            and _fp8_tensor_cores(x8.device))


def fp8_matmul_auto(x8: Tensor, x_scale: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None,
                    *, out_dtype: torch.dtype, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm`` where it runs (``scaled_mm_runs``), else the twin."""
    fits = x8.ndim == 2 and weight8.ndim == 2 and scaled_mm_runs(x8, x8.shape[-1], weight8.shape[0], out_dtype)
    fn = fp8_matmul if fits else fp8_matmul_torch
    return fn(x8, x_scale, weight8, weight_scale, bias, out_dtype=out_dtype, out=out, use_fast_accum=use_fast_accum)


# -- fp8_linear ------------------------------------------------------------------------------------
def _linear(quantize, matmul, x: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None,
            gelu_input: bool, out: Tensor | None, use_fast_accum: bool) -> Tensor:
    if x.ndim < 1 or weight8.ndim != 2 or x.shape[-1] != weight8.shape[1]:
        raise ValueError(f"x must be [..., K] for weight8 [N, K], got {tuple(x.shape)} and {tuple(weight8.shape)}")
    n = weight8.shape[0]
    if out is not None and tuple(out.shape) not in ((*x.shape[:-1], n), (math.prod(x.shape[:-1]), n)):
        raise ValueError(f"out must be [..., N={n}] for x {tuple(x.shape)}, got {tuple(out.shape)}")
    x8, x_scale = quantize(x.reshape(-1, x.shape[-1]), gelu_input)
    y = matmul(x8, x_scale, weight8, weight_scale, bias, out_dtype=x.dtype,
               out=None if out is None else out.view(-1, n), use_fast_accum=use_fast_accum)
    return out if out is not None else y.view(*x.shape[:-1], n)


def fp8_linear_torch(x: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None, *,
                     gelu_input: bool = False, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """Reference twin: ``quantize_rows_torch`` then ``fp8_matmul_torch``."""
    return _linear(quantize_rows_torch, fp8_matmul_torch, x, weight8, weight_scale, bias, gelu_input, out,
                   use_fast_accum)


def fp8_linear(x: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None, *,
               gelu_input: bool = False, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """The kernel (``quantize_rows``) and ``torch._scaled_mm`` (``fp8_matmul``), with the twin's contract."""
    return _linear(quantize_rows, fp8_matmul, x, weight8, weight_scale, bias, gelu_input, out, use_fast_accum)


def fp8_linear_auto(x: Tensor, weight8: Tensor, weight_scale: Tensor, bias: Tensor | None = None, *,
                    gelu_input: bool = False, out: Tensor | None = None, use_fast_accum: bool = False) -> Tensor:
    """``quantize_rows_auto`` then ``fp8_matmul_auto``: the GPU path on CUDA with fp8 tensor cores, the
    twins elsewhere."""
    return _linear(quantize_rows_auto, fp8_matmul_auto, x, weight8, weight_scale, bias, gelu_input, out,
                   use_fast_accum)


# -- weights ---------------------------------------------------------------------------------------
@torch.no_grad()
def quantize_weight(w: Tensor, scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """``(w8 [N, K] e4m3, scale [1, N] fp32)`` of a linear weight ``w [N, K]``. An e4m3 ``w`` is returned
    as it is (copied only if strided), with ``scale`` (None: 1; one value, or one per output channel)
    as its scale; any other dtype is quantized per output channel (``quantize_rows_torch``: a one-time
    cost, in the twin's exact arithmetic)."""
    if w.ndim != 2:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")
    n = w.shape[0]
    if w.dtype == E4M3:
        s = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32, device=w.device)
        if s.numel() not in (1, n):
            raise ValueError(f"scale must be one value or one per output channel (N={n}), got {tuple(s.shape)}")
        # _scaled_mm wants the weight row-major (its .t() column-major) and the scale [1, N] with unit stride
        return w if w.is_contiguous() else w.contiguous(), s.reshape(1, -1).expand(1, n).contiguous()
    if scale is not None:
        raise ValueError(f"a scale is taken with an e4m3 weight only, got a {w.dtype} weight")
    w8, s = quantize_rows_torch(w if w.dtype in _DTYPES else w.float())
    return w8, s.reshape(1, n)
