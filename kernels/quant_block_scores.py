"""AnnSA 'quant' planning scores: int8 scores of key blocks against query blocks, as one Triton kernel.

Why: the selection scores every block of sorted history keys (its int8 mean key) against every
query of a query block and keeps the best; a program per query block writes only the block max,
never the ``[Lq, n_key_blocks]`` score matrix eager PyTorch builds.

Semantics (the twin defines them): queries ``q [B, H, Lq, D]`` are cut, in their order, into blocks
of ``block_q`` (the last may be shorter), each quantized on its own scale: ``inv = 127 / max(max |q|
over the block, 1e-12)``, levels ``clamp(floor(q * inv + 0.5), -127, 127)``. The score of key block
``j`` for query block ``i`` is

    max over the block's queries of (levels . key_means[b, h, j]) * (logit_scale[b, h] / inv) + block_bias[b, h, j]

an estimate of the block's log attention mass: ``logit_scale`` (the key means' scale over sqrt(D))
and ``1 / inv`` turn the integer dot back into a logit; ``block_bias`` is the log of the block's key
multiplicity (logsumexp of TempCache's log m over its keys; ``-inf`` for a block with no key, which
then scores ``-inf``). The scale is per query block, not per head: computed where the block is
loaded (no pass over the queries first), and it resolves each block's queries more finely.

Exactness: products within +-127 summed over D <= 256 are exact in fp32, so the fp16 tensor-core
dot gives the twin's integers. Divisions round to nearest (``div_rn``) and FMA contraction is off
(``enable_fp_fusion=False``): fused, ``q * inv + 0.5`` rounds once and moves a query on a half-step
to the next level, and ``best * scale + bias`` differs in the last ulp. So results equal the
twin's, not just approach them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["quant_block_scores", "quant_block_scores_auto", "quant_block_scores_torch", "quantize_blocks"]


def quantize_blocks(q: Tensor, block_q: int) -> tuple[Tensor, Tensor]:
    """q [B, H, L, D] -> (int8 levels as fp32 [B, H, nqb * block_q, D], zero-padded to whole
    blocks; ``inv`` [B, H, nqb], each block's 127 / max |q|)."""
    b, h, lq, d = q.shape
    nqb = -(-lq // block_q)
    x = torch.nn.functional.pad(q.float(), (0, 0, 0, nqb * block_q - lq))
    amax = x.reshape(b, h, nqb, block_q * d).abs().amax(-1).clamp_min(1e-12)  # q may be a strided view
    inv = amax.new_full((), 127.0) / amax  # a true division (``127 / t`` multiplies by a reciprocal)
    levels = torch.floor(x.reshape(b, h, nqb, block_q, d) * inv[..., None, None] + 0.5).clamp_(-127, 127)
    return levels.view(b, h, nqb * block_q, d), inv


def check_scores_inputs(q, key_means, logit_scale, block_bias, block_q):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, Lq, D], got {tuple(q.shape)}")
    b, h, lq, d = q.shape
    if key_means.ndim != 4 or key_means.shape[:2] != (b, h) or key_means.shape[3] != d or key_means.dtype != torch.int8:
        raise ValueError(f"key_means must be int8 [B, H, n_key_blocks, D={d}], got {key_means.dtype} {tuple(key_means.shape)}")
    if tuple(logit_scale.shape) != (b, h) or logit_scale.dtype != torch.float32:
        raise ValueError(f"logit_scale must be float32 [B, H] = [{b}, {h}], got {logit_scale.dtype} "
                         f"{tuple(logit_scale.shape)}")
    if tuple(block_bias.shape) != tuple(key_means.shape[:3]) or block_bias.dtype != torch.float32:
        raise ValueError(f"block_bias must be float32 {tuple(key_means.shape[:3])}, got {block_bias.dtype} "
                         f"{tuple(block_bias.shape)}")
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    return b, h, lq, d, -(-lq // block_q), key_means.shape[2]


def quant_block_scores_torch(q: Tensor, key_means: Tensor, logit_scale: Tensor, block_bias: Tensor,
                             block_q: int) -> Tensor:
    """Reference twin: scores [B, H, n_query_blocks, n_key_blocks] (fp32)."""
    b, h, lq, d, nqb, nkb = check_scores_inputs(q, key_means, logit_scale, block_bias, block_q)
    levels, inv = quantize_blocks(q, block_q)
    pad_rows = (torch.arange(nqb * block_q, device=q.device) >= lq)[:, None]
    dots = torch.stack([  # one head at a time: [B, Lq, nkb] stays small
        (levels[:, i] @ key_means[:, i].float().transpose(-1, -2)).masked_fill_(pad_rows, float("-inf"))
        .view(b, nqb, block_q, nkb).amax(2) for i in range(h)], dim=1)
    return dots * (logit_scale[..., None] / inv)[..., None] + block_bias[:, :, None]


def kernel_fits(d: int, block_q: int) -> bool:
    """The shapes both kernels take: D a power of two in [16, 256], block_q <= 256."""
    return 16 <= d <= 256 and power_of_two(d) and block_q <= 256


def check_kernel(q, d: int, block_q: int) -> None:
    if not kernel_fits(d, block_q):
        raise ValueError(f"kernel needs D a power of two in [16, 256] and block_q <= 256, got D={d}, block_q={block_q}")
    check_triton_runs_on(q)


if HAS_TRITON:

    @triton.jit
    def query_levels(q_ptr, pid_m, pid_bh, H, Lq, block_q, stride_qb, stride_qh, stride_ql, stride_qd,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """A query block's int8 levels [BLOCK_M, D] (in DOT_DTYPE), its ``inv`` and which rows are queries."""
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        offs_i, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, D)
        rows = pid_m * block_q + offs_i
        row_ok = (offs_i < block_q) & (rows < Lq)
        qt = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_ql
                     + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
        inv = tl.math.div_rn(127.0, tl.maximum(tl.max(tl.max(tl.abs(qt), 1), 0), 1e-12))
        return tl.minimum(tl.maximum(tl.floor(qt * inv + 0.5), -127.0), 127.0).to(DOT_DTYPE), inv, row_ok

    @triton.jit(do_not_specialize=["H", "Lq", "NKB", "block_q"])
    def _quant_scores_kernel(q_ptr, k_ptr, scale_ptr, bias_ptr, s_ptr, H, Lq, NKB, block_q,
                             stride_qb, stride_qh, stride_ql, stride_qd,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             DOT_DTYPE: tl.constexpr):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        offs_d, offs_k = tl.arange(0, D), tl.arange(0, BLOCK_K)
        qt, inv, row_ok = query_levels(q_ptr, pid_m, pid_bh, H, Lq, block_q, stride_qb, stride_qh, stride_ql,
                                        stride_qd, D, BLOCK_M, DOT_DTYPE)
        logit_scale = tl.math.div_rn(tl.load(scale_ptr + pid_bh), inv)
        k_base = k_ptr + pid_bh.to(tl.int64) * NKB * D
        s_base = s_ptr + (pid_bh.to(tl.int64) * tl.cdiv(Lq, block_q) + pid_m) * NKB
        # [D, BLOCK_M]: scores come out [key block, query], so the max over queries runs along
        # accumulator rows (lane shuffles, not a reduction across warps)
        qt = tl.trans(qt)
        for j0 in range(0, NKB, BLOCK_K):
            cols = j0 + offs_k
            col_ok = cols < NKB
            kt = tl.load(k_base + cols[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0).to(DOT_DTYPE)
            s = tl.dot(kt, qt, input_precision="ieee" if DOT_DTYPE == tl.float32 else None, out_dtype=tl.float32)
            best = tl.max(tl.where(row_ok[None, :], s, float("-inf")), 1)
            bias = tl.load(bias_ptr + pid_bh.to(tl.int64) * NKB + cols, mask=col_ok, other=0.0)
            tl.store(s_base + cols, best * logit_scale + bias, mask=col_ok)


def quant_block_scores(q: Tensor, key_means: Tensor, logit_scale: Tensor, block_bias: Tensor, block_q: int) -> Tensor:
    """Triton kernel with the twin's contract (D a power of two in [16, 256], block_q <= 256)."""
    if not HAS_TRITON:
        raise RuntimeError("quant_block_scores needs triton, which is not importable")
    b, h, lq, d, nqb, nkb = check_scores_inputs(q, key_means, logit_scale, block_bias, block_q)
    check_kernel(q, d, block_q)
    scores = torch.empty(b, h, nqb, nkb, dtype=torch.float32, device=q.device)
    if scores.numel():
        _quant_scores_kernel[(nqb, b * h)](
            q, key_means.contiguous(), logit_scale.contiguous(), block_bias.contiguous(), scores,
            h, lq, nkb, block_q, *q.stride(),
            D=d, BLOCK_M=max(16, triton.next_power_of_2(block_q)), BLOCK_K=64,
            # fp16 tensor cores on the GPU, fp32 under the interpreter: exact either way
            DOT_DTYPE=tl.float16 if q.is_cuda else tl.float32, num_warps=4, enable_fp_fusion=False)
    return scores


def quant_block_scores_auto(q, key_means, logit_scale, block_bias, block_q: int) -> Tensor:
    """The kernel where Triton runs and the shapes suit it, else the twin."""
    d = q.shape[-1]
    fits = kernel_fits(d, block_q) and q.dtype != torch.float64
    fn = quant_block_scores if use_kernel(q, fits) else quant_block_scores_torch
    return fn(q, key_means, logit_scale, block_bias, block_q)
