"""AnnSA 'quant' top-p planning shares: each key block's estimated share of a query block's
attention mass, as one Triton kernel.

Semantics (the twin defines them): the logits of ``kernels/quant_block_scores.py``, reduced per
query instead of per block: a query's share in each key block is ``exp(logit - lse)``, ``lse``
over its logits against the history blocks and the ``fixed`` blocks (the sink's and the open
chunk's: float mean keys read in fp16, ``levels . mean / (inv * sqrt(D))`` plus the log of their
key counts); averaged over the block's queries as ``log_share [B, H, nqb, nkb]`` and
``log_fixed_share [B, H, nqb]``.

Why per query, not the block max: a query block mixing two clusters whose logits differ in scale
would credit the sharper cluster's blocks with the whole block's mass. Why float means for the
fixed blocks: the open chunk's change every call, and ``kernels/block_means.py`` then writes them
where the plan reads them, with no int8 pass.

Dots and divisions are exact as in the scores; exp and log round differently in Triton and torch,
so the shares are close to the twin's, not equal.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import HAS_TRITON, use_kernel
from .quant_block_scores import check_scores_inputs, check_kernel, kernel_fits, quantize_blocks

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .quant_block_scores import query_levels

__all__ = ["quant_block_shares", "quant_block_shares_auto", "quant_block_shares_torch"]


def _check_fixed(q, fixed_means, fixed_counts):
    b, h, _, d = q.shape
    if fixed_means.ndim != 4 or fixed_means.shape[:2] != (b, h) or fixed_means.shape[3] != d or \
            not fixed_means.is_floating_point() or fixed_means.shape[2] < 1:
        raise ValueError(f"fixed_means must be float [B, H, n_fixed >= 1, D={d}], got {fixed_means.dtype} "
                         f"{tuple(fixed_means.shape)}")
    if tuple(fixed_counts.shape) != tuple(fixed_means.shape[:3]) or fixed_counts.dtype != torch.float32:
        raise ValueError(f"fixed_counts must be float32 {tuple(fixed_means.shape[:3])}, got {fixed_counts.dtype} "
                         f"{tuple(fixed_counts.shape)}")


def quant_block_shares_torch(q: Tensor, key_means: Tensor, logit_scale: Tensor, block_bias: Tensor, fixed_means: Tensor,
                             fixed_counts: Tensor, block_q: int) -> tuple[Tensor, Tensor]:
    """Reference twin: (log_share [B, H, nqb, nkb], log_fixed_share [B, H, nqb]), fp32."""
    b, h, lq, d, nqb, nkb = check_scores_inputs(q, key_means, logit_scale, block_bias, block_q)
    _check_fixed(q, fixed_means, fixed_counts)
    levels, inv = quantize_blocks(q, block_q)
    valid = (torch.arange(nqb * block_q, device=q.device) < lq).view(nqb, block_q)
    n = valid.sum(1).float()  # valid queries per block
    fixed_scale = torch.full_like(logit_scale, 1 / math.sqrt(d))
    fixed_means, fixed_bias = fixed_means.half().float(), fixed_counts.log()
    shares, fixed_shares = [], []
    for i in range(h):  # one head at a time: [B, Lq, nkb] stays small
        def logits(means, scale, bias):
            per_q = (scale[:, i, None] / inv[:, i]).repeat_interleave(block_q, -1)[..., None]  # [B, nqb * block_q, 1]
            return levels[:, i] @ means[:, i].float().transpose(-1, -2) * per_q + bias[:, i, None]

        hist = logits(key_means, logit_scale, block_bias)
        lse_f = logits(fixed_means, fixed_scale, fixed_bias).logsumexp(-1, keepdim=True)
        lse = torch.logaddexp(lse_f, hist.logsumexp(-1, keepdim=True))
        share = ((hist - lse).exp().view(b, nqb, block_q, nkb) * valid[..., None]).sum(2) / n[:, None]
        fixed_share = ((lse_f - lse).exp().view(b, nqb, block_q) * valid).sum(2) / n
        shares.append(share.log())
        fixed_shares.append(fixed_share.log())
    return torch.stack(shares, 1), torch.stack(fixed_shares, 1)


if HAS_TRITON:

    @triton.jit
    def _logits(k_base, bias_base, j0, NKB, qt, logit_scale, offs_k, offs_d, D: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """Logits [BLOCK_K, BLOCK_M] of key blocks j0 + offs_k (int8 means at k_base) against the
        transposed query levels qt [D, BLOCK_M]; -inf past NKB. Key blocks along rows, so a sum over
        queries runs along accumulator rows (lane shuffles, not a reduction across warps)."""
        cols = j0 + offs_k
        col_ok = cols < NKB
        kt = tl.load(k_base + cols[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0).to(DOT_DTYPE)
        s = tl.dot(kt, qt, input_precision="ieee" if DOT_DTYPE == tl.float32 else None, out_dtype=tl.float32)
        bias = tl.load(bias_base + cols, mask=col_ok, other=float("-inf"))
        return s * logit_scale + bias[:, None]

    @triton.jit
    def _query_logits(k_base, bias_base, j0, NKB, q, logit_scale, offs_k, offs_d, D: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, FIXED: tl.constexpr):
        """Logits [BLOCK_M, BLOCK_K] of query levels q [BLOCK_M, D] against key blocks j0 + offs_k,
        queries along rows (for each query's logsumexp). FIXED: float means read in fp16 and key
        counts (their log the bias); else int8 means and log masses."""
        cols = j0 + offs_k
        col_ok = cols < NKB
        kt = tl.load(k_base + cols[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0)
        if FIXED:
            kt = kt.to(tl.float16)
        s = tl.dot(q, tl.trans(kt.to(DOT_DTYPE)), input_precision="ieee" if DOT_DTYPE == tl.float32 else None,
                   out_dtype=tl.float32)
        if FIXED:
            bias = tl.log(tl.load(bias_base + cols, mask=col_ok, other=0.0))
        else:
            bias = tl.load(bias_base + cols, mask=col_ok, other=float("-inf"))
        return s * logit_scale + bias[None, :]

    @triton.jit
    def _lse_update(m, l, s):
        """Online logsumexp over axis 1 of s [BLOCK_M, BLOCK_K] into (m, l) [BLOCK_M]."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)

    @triton.jit(do_not_specialize=["H", "Lq", "NKB", "NF", "block_q"])
    def _quant_shares_kernel(q_ptr, k_ptr, scale_ptr, bias_ptr, f_ptr, fcount_ptr, s_ptr, fs_ptr, H, Lq,
                             NKB, NF, block_q, fixed_scale, stride_qb, stride_qh, stride_ql, stride_qd,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        offs_d, offs_k = tl.arange(0, D), tl.arange(0, BLOCK_K)
        q, inv, row_ok = query_levels(q_ptr, pid_m, pid_bh, H, Lq, block_q, stride_qb, stride_qh, stride_ql,
                                       stride_qd, D, BLOCK_M, DOT_DTYPE)
        scale = tl.math.div_rn(tl.load(scale_ptr + pid_bh), inv)
        fscale = tl.math.div_rn(fixed_scale, inv)
        k_base, bias_base = k_ptr + pid_bh.to(tl.int64) * NKB * D, bias_ptr + pid_bh.to(tl.int64) * NKB
        f_base, fcount_base = f_ptr + pid_bh.to(tl.int64) * NF * D, fcount_ptr + pid_bh.to(tl.int64) * NF
        # each query's logsumexp: the fixed blocks, then the history's
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        for j0 in range(0, NF, BLOCK_K):
            m, l = _lse_update(m, l, _query_logits(f_base, fcount_base, j0, NF, q, fscale, offs_k, offs_d, D,
                                                   DOT_DTYPE, True))
        lse_f = m + tl.log(l)
        for j0 in range(0, NKB, BLOCK_K):
            m, l = _lse_update(m, l, _query_logits(k_base, bias_base, j0, NKB, q, scale, offs_k, offs_d, D,
                                                   DOT_DTYPE, False))
        lse = m + tl.log(l)
        fixed_share = tl.sum(tl.where(row_ok, tl.exp(lse_f - lse), 0.0), 0)
        # then each block's mean share, from logits with the blocks along rows
        qt, n = tl.trans(q), tl.sum(row_ok.to(tl.float32), 0)
        row = pid_bh.to(tl.int64) * tl.cdiv(Lq, block_q) + pid_m
        for j0 in range(0, NKB, BLOCK_K):
            s = _logits(k_base, bias_base, j0, NKB, qt, scale, offs_k, offs_d, D, DOT_DTYPE)
            share = tl.sum(tl.where(row_ok[None, :], tl.exp(s - lse[None, :]), 0.0), 1) / n
            cols = j0 + offs_k
            tl.store(s_ptr + row * NKB + cols, tl.log(share), mask=cols < NKB)
        tl.store(fs_ptr + row, tl.log(fixed_share / n))


def quant_block_shares(q: Tensor, key_means: Tensor, logit_scale: Tensor, block_bias: Tensor, fixed_means: Tensor,
                       fixed_counts: Tensor, block_q: int) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract (D a power of two in [16, 256], block_q <= 256)."""
    if not HAS_TRITON:
        raise RuntimeError("quant_block_shares needs triton, which is not importable")
    b, h, lq, d, nqb, nkb = check_scores_inputs(q, key_means, logit_scale, block_bias, block_q)
    _check_fixed(q, fixed_means, fixed_counts)
    check_kernel(q, d, block_q)
    shares = torch.empty(b, h, nqb, nkb, dtype=torch.float32, device=q.device)
    fixed_shares = torch.empty(b, h, nqb, dtype=torch.float32, device=q.device)
    if fixed_shares.numel():
        _quant_shares_kernel[(nqb, b * h)](
            q, key_means.contiguous(), logit_scale.contiguous(), block_bias.contiguous(), fixed_means.contiguous(),
            fixed_counts.contiguous(), shares, fixed_shares, h, lq, nkb, fixed_means.shape[2], block_q,
            1 / math.sqrt(d), *q.stride(), D=d, BLOCK_M=max(16, triton.next_power_of_2(block_q)),
            # 128 key blocks a tile, one stage: the program is latency-bound, not by its dots
            BLOCK_K=128, num_stages=1,
            DOT_DTYPE=tl.float16 if q.is_cuda else tl.float32, num_warps=4, enable_fp_fusion=False)
    return shares, fixed_shares


def quant_block_shares_auto(q, key_means, logit_scale, block_bias, fixed_means, fixed_counts,
                            block_q: int) -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs and the shapes suit it, else the twin."""
    d = q.shape[-1]
    fits = kernel_fits(d, block_q) and q.dtype != torch.float64
    fn = quant_block_shares if use_kernel(q, fits) else quant_block_shares_torch
    return fn(q, key_means, logit_scale, block_bias, fixed_means, fixed_counts, block_q)
