"""Block-sparse flash attention (AnnSA's attention): Triton kernel, torch twin, dispatcher.

The plan format is ``kernels/plan.py``'s, the launch model (tile sizes, key splits)
``kernels/launch.py``'s.

Semantics (the twin defines them): q ``[B, H, Lq, D]``, k / v ``[B, H, Lk, D]`` (any strides).
Query block ``i`` of head ``(b, h)`` (``block_q`` consecutive queries) attends to the keys its plan
names, with logits ``scale * q . k + key_bias[b, h, key]`` (``key_bias``: TempCache's ``log m``)
and a softmax over exactly those keys.

- Without a prior, a query block with no keys, and a query whose every key has bias ``-inf``
  (empty TempCache slots), output zeros, never NaN.
- ``bias_window=(lo, hi)``: the bias applies to keys ``[lo, hi)`` only, 0 elsewhere (TempCache's
  history window; the sink and the open chunk hold unmerged keys). A range wholly outside the
  window skips the bias's per-score work.
- ``prior=(out, lse)``: a softmax already taken over keys outside the plan (natural-log lse per
  query; -inf: none), e.g. cuDNN's over the keys every block reads. The result is the softmax over
  both key sets; the kernel starts each block's online softmax from it, so it needs no combine.

The twin checks the plan's values (``validate_plan``, a host sync) and raises ``ValueError``; the
kernel, which must not sync, checks only shapes, dtypes and devices and, for memory safety, clamps
counts to ``[0, R]`` and ranges to ``[0, Lk]`` (a reversed range reads nothing).

Kernel layout: one program per (query block, head) holds the query block in registers and streams
its ranges' keys in ``block_n`` tiles with an fp32 online softmax in base 2. Each range is its full
tiles, unmasked, then at most one masked tail tile, so no length or bound need be aligned. The
batch, head and key strides of q, k, v and the prior's output are explicit (D's is 1; o takes
q's; the plan is contiguous), so the KV cache's ``[B, L, H, D]`` storage is read in place through
``.transpose(1, 2)`` views. Items ``launch.split_items`` splits are cut into even shares of their
keys (on whole tiles), one program each writing an fp32 partial and its lse, joined by a combine
pass.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel
from .launch import TUNABLES, block_m, device_wave, launch_config, split_items, tile_offsets_fit
from .plan import check_block_q, check_plan, validate_plan

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["block_sparse_attention", "block_sparse_attention_auto", "block_sparse_attention_torch",
           "kernel_supports"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TWIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_LOG2E = 1.4426950408889634


def _check_bias_window(bias_window, Lk: int) -> tuple[int, int]:
    """``bias_window`` as ints ``(lo, hi)`` with ``0 <= lo <= hi``, clipped to Lk; None: all keys."""
    if bias_window is None:
        return 0, Lk
    try:
        lo, hi = (operator.index(x) for x in bias_window)
    except (TypeError, ValueError):
        raise ValueError(f"bias_window must be a pair of ints (lo, hi) or None, got {bias_window!r}") from None
    if not 0 <= lo <= hi:
        raise ValueError(f"bias_window must satisfy 0 <= lo <= hi, got ({lo}, {hi})")
    return min(lo, Lk), min(hi, Lk)


def _check_prior(prior, q: Tensor) -> tuple[Tensor, Tensor] | None:
    """``prior`` = (out [B, H, Lq, D], lse [B, H, Lq] fp32): a softmax already taken over other keys."""
    if prior is None:
        return None
    try:
        o, lse = prior
    except (TypeError, ValueError):
        raise ValueError("prior must be a pair (out, lse) of tensors or None") from None
    if not isinstance(o, Tensor) or not isinstance(lse, Tensor):
        raise ValueError("prior must be a pair (out, lse) of tensors or None")
    if o.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"prior must be (out {list(q.shape)}, lse {list(q.shape[:3])}), "
                         f"got ({list(o.shape)}, {list(lse.shape)})")
    if lse.dtype != torch.float32 or not o.is_floating_point():
        raise ValueError(f"prior: lse must be float32 and out floating point, got {lse.dtype} / {o.dtype}")
    if o.device != q.device or lse.device != q.device:
        raise ValueError(f"device mismatch: q on {q.device}, prior on {o.device} / {lse.device}")
    return o, lse


def _check_call(q, k, v, ranges, range_counts, key_bias, block_q, scale, bias_window, prior):
    """The checks kernel and twin share (no host sync). Returns (B, H, Lq, Lk, D, nqb, R, block_q,
    scale, (lo, hi), prior): the resolved scale, bias window and prior."""
    for name, t in (("q", q), ("k", k), ("v", v), ("ranges", ranges), ("range_counts", range_counts)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, L, D], got shape {tuple(t.shape)}")
    B, H, Lq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(
            f"batch/head mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k {tuple(k.shape)}, v {tuple(v.shape)}")
    Lk = k.shape[2]
    if k.shape[3] != D:
        raise ValueError(f"head dim D mismatch: q has D={D}, k/v have D={k.shape[3]}")
    if q.dtype not in _TWIN_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported (bf16/fp16/fp32)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype} (must be equal)")
    block_q = check_block_q(block_q)
    nqb, R = check_plan(ranges, range_counts, B, H, Lq, block_q)
    named = {"k": k, "v": v, "ranges": ranges, "range_counts": range_counts}
    if key_bias is not None:
        if not isinstance(key_bias, Tensor):
            raise ValueError(f"key_bias must be a tensor or None, got {type(key_bias).__name__}")
        if key_bias.dtype != torch.float32:
            raise ValueError(f"key_bias must be float32, got {key_bias.dtype}")
        if tuple(key_bias.shape) != (B, H, Lk):
            raise ValueError(
                f"key_bias must have shape [B, H, Lk] = [{B}, {H}, {Lk}], got {tuple(key_bias.shape)}"
            )
        named["key_bias"] = key_bias
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"device mismatch: q on {q.device}, {name} on {t.device}")
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    prior = _check_prior(prior, q)
    return B, H, Lq, Lk, D, nqb, R, block_q, scale, _check_bias_window(bias_window, Lk), prior


def block_sparse_attention_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ranges: Tensor,
    range_counts: Tensor,
    *,
    key_bias: Tensor | None = None,
    block_q: int = 64,
    scale: float | None = None,
    bias_window: tuple[int, int] | None = None,
    prior: tuple[Tensor, Tensor] | None = None,
    **tunables,
) -> Tensor:
    """Reference twin (module docstring): per (b, h, query block), its keys gathered, fp32 softmax.

    Takes the kernel's launch parameters (``launch.TUNABLES``) and ignores them; also takes fp64.
    The result has q's shape, dtype and (where q is dense) memory layout.
    """
    unknown = sorted(set(tunables) - set(TUNABLES))
    if unknown:
        raise TypeError(f"block_sparse_attention_torch() got unexpected keyword arguments {unknown}")
    B, H, Lq, Lk, D, nqb, R, block_q, scale, (lo, hi), prior = _check_call(
        q, k, v, ranges, range_counts, key_bias, block_q, scale, bias_window, prior
    )
    validate_plan(ranges, range_counts, Lk, key_bias)
    if key_bias is not None and (lo, hi) != (0, Lk):
        windowed = torch.zeros_like(key_bias)
        windowed[..., lo:hi] = key_bias[..., lo:hi]
        key_bias = windowed
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, Lq, D, dtype=acc_dtype, device=q.device)
    lse = torch.full((B, H, Lq), float("-inf"), dtype=acc_dtype, device=q.device)  # natural log
    if out.numel() and Lk:
        counts = range_counts.tolist()
        plan = ranges.tolist()
        for b in range(B):
            for h in range(H):
                for i in range(nqb):
                    spans = [(s, e) for s, e in plan[b][h][i][: counts[b][h][i]] if e > s]
                    if not spans:
                        continue  # no keys: the block's rows stay zero
                    idx = torch.cat([torch.arange(s, e, device=q.device) for s, e in spans])
                    rows = slice(i * block_q, min((i + 1) * block_q, Lq))
                    qs = q[b, h, rows].to(acc_dtype)
                    logits = (qs @ k[b, h, idx].to(acc_dtype).T) * scale
                    if key_bias is not None:
                        logits = logits + key_bias[b, h, idx].to(acc_dtype)
                    mx = logits.amax(dim=-1, keepdim=True)
                    mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)  # all -inf row
                    p = torch.exp(logits - mx)
                    denom = p.sum(dim=-1, keepdim=True)
                    o = (p @ v[b, h, idx].to(acc_dtype)) / torch.where(denom > 0, denom, 1.0)
                    out[b, h, rows] = o
                    lse[b, h, rows] = (mx + denom.log()).squeeze(-1)
    if prior is not None:  # two softmaxes joined: weights exp(lse - max) of each part
        p_out, p_lse = prior[0].to(acc_dtype), prior[1].to(acc_dtype)
        top = torch.maximum(lse, p_lse)
        top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
        w, p_w = (lse - top).exp(), (p_lse - top).exp()
        den = w + p_w
        out = (w[..., None] * out + p_w[..., None] * torch.where(p_w[..., None] > 0, p_out, 0.0)) / torch.where(
            den > 0, den, 1.0)[..., None]
    result = torch.empty_like(q)
    result.copy_(out)
    return result


if HAS_TRITON:

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        qt,
        k_tile,
        v_tile,
        b_tile,
        k_offs,
        v_offs,
        offs_n,
        n_valid,
        qk_scale,
        HAS_BIAS: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """One key tile of the online softmax (base-2 logits); returns the updated (acc, l_i, m_i).

        ``k_tile`` / ``v_tile`` / ``b_tile`` point at the tile's first key. A full tile reads BLOCK_N
        keys unmasked; a ``MASKED`` tail tile the first ``n_valid`` (< BLOCK_N), the rest at -inf.
        """
        if MASKED:
            col_ok = offs_n < n_valid
        if HAS_BIAS:
            # Issued first: its latency hides behind the K load and the QK^T dot.
            if MASKED:
                kb = tl.load(b_tile + offs_n, mask=col_ok, other=float("-inf"))
            else:
                kb = tl.load(b_tile + offs_n)
        if MASKED:
            kt = tl.load(k_tile + k_offs, mask=col_ok[:, None], other=0.0)
            # The tail tile is not software-pipelined: V issued with K overlaps their latencies.
            vt = tl.load(v_tile + v_offs, mask=col_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_tile + k_offs)
        if kt.dtype == tl.float32:  # fp32 inputs: an IEEE dot, to match the twin
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(qt, tl.trans(kt))
        if HAS_BIAS:
            # Masked columns: 0 * scale + -inf = -inf. A key with bias -inf likewise.
            t = s * qk_scale + kb[None, :]
            m_new = tl.maximum(m_i, tl.max(t, 1))
            # A row with no finite logit yet keeps m = -inf: shift by 0 there, so no NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(t - m_use[:, None])
        elif MASKED:
            t = tl.where(col_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(t, 1))  # finite: the tile has >= 1 valid key
            m_use = m_new
            p = tl.math.exp2(t - m_use[:, None])
        else:
            # Every logit finite: the row max is scale * max(s) (the wrapper makes the scale positive),
            # so scaling and shifting fuse into one FMA per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not MASKED:
            vt = tl.load(v_tile + v_offs)
        p = p.to(vt.dtype)
        acc = acc * alpha[:, None]
        if vt.dtype == tl.float32:
            acc = tl.dot(p, vt, acc, input_precision="ieee")
        else:
            acc = tl.dot(p, vt, acc)
        return acc, l_i, m_new

    @triton.jit
    def _attend_range(acc, l_i, m_i, qt, k_tile, v_tile, b_tile, k_offs, v_offs, offs_n, n_keys, k_step, v_step,
                      qk_scale, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
        """One range of keys: its full tiles unmasked, then at most one masked tail tile."""
        n_full = n_keys // BLOCK_N
        for _ in range(0, n_full):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, qt, k_tile, v_tile, b_tile, k_offs, v_offs, offs_n, BLOCK_N,
                qk_scale, HAS_BIAS, False,
            )
            k_tile += k_step
            v_tile += v_step
            b_tile += BLOCK_N
        n_tail = n_keys - n_full * BLOCK_N
        if n_tail > 0:
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, qt, k_tile, v_tile, b_tile, k_offs, v_offs, offs_n, n_tail,
                qk_scale, HAS_BIAS, True,
            )
        return acc, l_i, m_i

    @triton.jit
    def _split_cut(c, total, r_cum, r_len, BLOCK_N: tl.constexpr):
        """Key count ``c`` moved down to a tile boundary of the range it falls in (``total`` stays)."""
        inside = (r_cum <= c) & (c < r_cum + r_len)
        snapped = tl.sum(tl.where(inside, r_cum + (c - r_cum) // BLOCK_N * BLOCK_N, 0), 0)
        return tl.where(c >= total, total, snapped)

    # Sizes are not specialised on: their divisibility by 16 changes as an unbounded cache grows,
    # and each change would recompile mid-rollout; no alignment they carry is usable (tiles start
    # at unaligned range starts). The wrapper hands over unit strides along D, q and o in one
    # layout, the plan and the prior's lse contiguous.
    @triton.jit(do_not_specialize=["H", "Lq", "Lk", "R", "block_q", "bias_lo", "bias_hi", "n_whole", "n_split"])
    def _block_sparse_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,  # q's strides
        ranges_ptr,  # [B, H, n_qblocks, R, 2] contiguous
        counts_ptr,  # [B, H, n_qblocks] contiguous
        bias_ptr,  # [B, H, Lk] contiguous fp32, already multiplied by log2(e)
        part_ptr,  # SPLITS: each share's normalised output [shares, BLOCK_M, D], then its
        #            log2-sum-exp2 per row [shares, BLOCK_M], fp32
        prior_o_ptr,  # HAS_PRIOR: [B, H, Lq, D], unit stride along D, a softmax over keys outside the plan
        prior_lse_ptr,  # HAS_PRIOR: [B, H, Lq] contiguous fp32, its log-sum-exp (natural log)
        qk_scale,  # scale * log2(e) > 0: logits live in base 2 so the softmax uses exp2
        H,
        Lq,
        Lk,
        R,
        block_q,
        bias_lo,  # keys outside [bias_lo, bias_hi) have bias 0: ranges there skip it
        bias_hi,
        n_whole,  # SPLITS: items [0, n_whole) run whole, the rest in n_split programs each
        n_split,
        stride_qb,
        stride_qh,
        stride_ql,
        stride_kb,
        stride_kh,
        stride_kl,
        stride_vb,
        stride_vh,
        stride_vl,
        stride_pb,  # the prior's output: cuDNN's layout need not be q's, and a copy would cost what the
        stride_ph,  # prior saves
        stride_pl,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_PRIOR: tl.constexpr,
        SPLITS: tl.constexpr,
        R_BLOCK: tl.constexpr,
    ):
        """One program: one query block of one (b, h) against its ranges' keys (a split program:
        against one share of them, a partial result)."""
        pid = tl.program_id(0)
        n_qblocks = (Lq + block_q - 1) // block_q
        if SPLITS:
            is_split = pid >= n_whole
            share = tl.maximum(pid - n_whole, 0)
            item = tl.where(is_split, n_whole + share // n_split, pid)
            pid_s = share % n_split  # this program's share of a split item
        else:
            is_split: tl.constexpr = False  # only the whole item's store is compiled
            item = pid
        pid_m = item % n_qblocks
        pid_bh = item // n_qblocks
        # int64 bases: b * stride over a long cache can exceed 2**31 elements.
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)

        offs_i = tl.arange(0, BLOCK_M)
        offs_d = tl.max_contiguous(tl.multiple_of(tl.arange(0, D), D), D)
        offs_n = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        rows = pid_m * block_q + offs_i  # the block's queries
        row_ok = (offs_i < block_q) & (rows < Lq)

        # q and o share their layout: one set of offsets addresses both.
        qo_offs = b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_ql + offs_d[None, :]
        qt = tl.load(q_ptr + qo_offs, mask=row_ok[:, None], other=0.0)

        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        bias_base = bias_ptr + pid_bh.to(tl.int64) * Lk
        # In-tile offsets: loop-invariant int32 (the wrapper ensures they fit); the tile's int64
        # base is a scalar pointer advanced per tile.
        k_offs = offs_n[:, None] * stride_kl + offs_d[None, :]
        v_offs = offs_n[:, None] * stride_vl + offs_d[None, :]
        k_step = stride_kl.to(tl.int64) * BLOCK_N
        v_step = stride_vl.to(tl.int64) * BLOCK_N
        block = pid_bh.to(tl.int64) * n_qblocks + pid_m  # the query block's row of the plan
        r_base = ranges_ptr + block * R * 2
        count = tl.load(counts_ptr + block)
        count = tl.minimum(tl.maximum(count, 0), R)

        if SPLITS:
            # This program's share: keys [cut_lo, cut_hi) counted along the ranges (a whole item is
            # one share); cuts fall on tile boundaries within a range, so splits add no masked tile.
            offs_r = tl.arange(0, R_BLOCK)
            r_ok = offs_r < count
            r_start = tl.maximum(tl.load(r_base + offs_r * 2, mask=r_ok, other=0), 0)
            r_end = tl.minimum(tl.load(r_base + offs_r * 2 + 1, mask=r_ok, other=0), Lk)
            r_len = tl.maximum(r_end - r_start, 0)
            r_cum = tl.cumsum(r_len, 0) - r_len  # keys before each range
            total = tl.sum(r_len, 0)
            shares = tl.where(is_split, n_split, 1)
            cut_lo = _split_cut(total * pid_s // shares, total, r_cum, r_len, BLOCK_N)
            cut_hi = _split_cut(total * (pid_s + 1) // shares, total, r_cum, r_len, BLOCK_N)
            # Only the ranges the share overlaps are visited: a range's bounds cost two dependent loads.
            before = r_ok & (r_cum + r_len <= cut_lo)
            r_first = tl.sum(before.to(tl.int32), 0)
            r_last = tl.sum((r_ok & (r_cum < cut_hi)).to(tl.int32), 0)
            seen = tl.sum(tl.where(before, r_len, 0), 0)
        else:
            r_first = 0
            r_last = count

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if HAS_PRIOR:
            # The prior as the starting state: max = its lse (base 2), sum = 1, acc = its output.
            # A split item's first share takes it.
            take = row_ok
            if SPLITS:
                take = take & (offs_i * 0 + pid_s == 0)
            p_lse = tl.load(prior_lse_ptr + pid_bh.to(tl.int64) * Lq + rows, mask=take, other=float("-inf"))
            m_i = p_lse * 1.4426950408889634
            l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
            p_offs = b * stride_pb + h * stride_ph + rows.to(tl.int64)[:, None] * stride_pl + offs_d[None, :]
            acc = tl.load(prior_o_ptr + p_offs, mask=(l_i > 0)[:, None], other=0.0).to(tl.float32)
        for r in range(r_first, r_last):
            start = tl.maximum(tl.load(r_base + r * 2), 0)
            end = tl.minimum(tl.load(r_base + r * 2 + 1), Lk)
            n_keys = tl.maximum(end - start, 0)  # a reversed range reads nothing
            if SPLITS:
                skip = tl.minimum(tl.maximum(cut_lo - seen, 0), n_keys)
                seen += n_keys
                n_keys = tl.minimum(tl.maximum(cut_hi - (seen - n_keys), 0), n_keys) - skip
                start += skip
                end = start + n_keys
            k_tile = k_base + start.to(tl.int64) * stride_kl
            v_tile = v_base + start.to(tl.int64) * stride_vl
            b_tile = bias_base + start
            biased = False  # compile-time False without a bias: one softmax path compiled
            if HAS_BIAS:  # a range wholly outside the bias window has bias 0
                biased = (end > bias_lo) & (start < bias_hi)
            if biased:
                acc, l_i, m_i = _attend_range(
                    acc, l_i, m_i, qt, k_tile, v_tile, b_tile, k_offs, v_offs, offs_n, n_keys, k_step,
                    v_step, qk_scale, BLOCK_N, True,
                )
            else:  # the cheaper softmax
                acc, l_i, m_i = _attend_range(
                    acc, l_i, m_i, qt, k_tile, v_tile, b_tile, k_offs, v_offs, offs_n, n_keys, k_step,
                    v_step, qk_scale, BLOCK_N, False,
                )

        # l_i == 0 only where no key had a finite logit; acc is 0 there, so the row is 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if is_split:  # partials by the block's rows, which the combine joins into the output
            row_off = (share * BLOCK_M).to(tl.int64) + offs_i
            lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            lse_ptr = part_ptr + (tl.num_programs(0) - n_whole).to(tl.int64) * (BLOCK_M * D)
            tl.store(lse_ptr + row_off, lse, mask=row_ok)
            tl.store(part_ptr + row_off[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None])
        else:
            tl.store(o_ptr + qo_offs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["H", "Lq", "block_q", "n_qblocks", "n_whole", "n_split"])
    def _combine_splits_kernel(
        part_ptr, lse_ptr, o_ptr, H, Lq, block_q, n_qblocks, n_whole, n_split,
        stride_ob, stride_oh, stride_ol, stride_od,
        D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """One split item's shares joined: out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse);
        0 where no share saw a finite logit."""
        j = tl.program_id(0)
        item = n_whole + j
        pid_m = item % n_qblocks
        pid_bh = item // n_qblocks
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        offs_i = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        rows = pid_m * block_q + offs_i
        ok = (offs_i < block_q) & (rows < Lq)
        base = (j * n_split * BLOCK_M).to(tl.int64) + offs_i
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(n_split):
            m = tl.maximum(m, tl.load(lse_ptr + base + s * BLOCK_M, mask=ok, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        num = tl.zeros([BLOCK_M, D], tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        for s in range(n_split):
            w = tl.math.exp2(tl.load(lse_ptr + base + s * BLOCK_M, mask=ok, other=float("-inf")) - m)
            o = tl.load(part_ptr + (base + s * BLOCK_M)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
            num += w[:, None] * o
            den += w
        out = num / tl.where(den > 0, den, 1.0)[:, None]
        o_ptrs = o_ptr + b * stride_ob + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ol + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=ok[:, None])


def kernel_supports(q: Tensor, block_q) -> bool:
    """dtype, head dim and block size the kernel handles (D a power of two in [16, 256])."""
    D = q.shape[-1] if q.ndim == 4 else 0
    small = isinstance(block_q, int) and block_q <= 256
    return q.dtype in _KERNEL_DTYPES and 16 <= D <= 256 and not D & (D - 1) and small


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ranges: Tensor,
    range_counts: Tensor,
    *,
    key_bias: Tensor | None = None,
    block_q: int = 64,
    scale: float | None = None,
    bias_window: tuple[int, int] | None = None,
    prior: tuple[Tensor, Tensor] | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    wave: int | None = None,
) -> Tensor:
    """Triton kernel with the twin's contract (module docstring); no host sync.

    bf16 / fp16 (fp32 runs too, with an IEEE dot to match the twin, but slowly); D a power of two in
    [16, 256] (64 and 128 are tested); ``block_q`` in [1, 256], the tile being it rounded up to a
    power of two. Launch parameters (``kernels/launch.py``): ``block_n``, ``num_warps``,
    ``num_stages`` default to ``default_launch``; ``num_splits`` (1-16) splits every item's keys, 1
    none, None (default) only the last wave's, a wave being ``wave`` programs (None: what the GPU
    holds at once for this launch; 0: no split).
    """
    if not HAS_TRITON:
        raise RuntimeError("block_sparse_attention needs triton, which is not importable")
    B, H, Lq, Lk, D, nqb, R, block_q, scale, (lo, hi), prior = _check_call(
        q, k, v, ranges, range_counts, key_bias, block_q, scale, bias_window, prior
    )
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"dtype {q.dtype} unsupported by the kernel (bf16/fp16/fp32)")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"kernel needs head dim D a power of two in [16, 256], got D={D}")
    if block_q > 256:
        raise ValueError(f"kernel needs block_q <= 256 (one query block is one tile), got {block_q}")
    check_triton_runs_on(q)
    launch = launch_config(D, block_q, q.element_size(), block_n, num_warps, num_stages, num_splits, wave)
    bn = launch["block_n"]

    out = torch.empty_like(q)  # q's layout where q is dense
    if out.numel() == 0:
        return out
    if Lk == 0 or R == 0:
        if prior is None:
            return out.zero_()
        return out.copy_(torch.where(torch.isneginf(prior[1])[..., None], 0.0, prior[0]))

    # Off-GPU, the operands are taken in fp32 (exact for bf16/fp16): Triton 3.x's interpreter
    # multiplies bf16 dot operands as raw bits.
    if not q.is_cuda and q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    if scale < 0:  # scale * q.k = |scale| * (-q).k: the kernel's fused max needs a positive scale
        q, scale = -q, -scale
    # The kernel's layout: unit strides along D, q and o alike, in-tile offsets that fit int32;
    # anything else is copied.
    if q.stride(-1) != 1 or q.stride() != out.stride():
        q = q.contiguous()
        out = torch.empty_like(q, dtype=out.dtype)
    if k.stride(-1) != 1 or not tile_offsets_fit(k, bn):
        k = k.contiguous()
    if v.stride(-1) != 1 or not tile_offsets_fit(v, bn):
        v = v.contiguous()
    ranges, range_counts = ranges.contiguous(), range_counts.contiguous()
    # The bias in base 2, once per call and contiguous: one vector read per key tile, and the score
    # is one FMA (s * qk_scale + bias). Zeroed outside bias_window, so a range straddling its edge
    # reads the twin's values.
    bias = q  # dummy pointer, never read
    if key_bias is not None:
        bias = (key_bias * _LOG2E).contiguous()
        bias[..., :lo] = 0.0
        bias[..., hi:] = 0.0
    prior_o = prior_lse = q  # dummy pointers, never read
    if prior is not None:
        prior_o, prior_lse = prior[0], prior[1].contiguous()
        if prior_o.stride(-1) != 1:
            prior_o = prior_o.contiguous()
    prior_strides = prior_o.stride()[:3] if prior is not None else (0, 0, 0)
    bm = block_m(block_q)
    n_items = nqb * B * H
    # Without a split, an fp32 stand-in typed as the split's buffer (never read), so that the wave's
    # warm-up compiles the very kernel a split launch runs.
    part = q.new_empty(0, dtype=torch.float32)
    r_block = max(2, 1 << (R - 1).bit_length())  # a split program's ranges as one vector: compiles as R doubles

    def run(n_whole: int, n_split: int, warmup: bool = False):
        splits = n_whole < n_items
        kernel = _block_sparse_attention_kernel.warmup if warmup else _block_sparse_attention_kernel[
            (n_whole + (n_items - n_whole) * n_split,)]
        return kernel(
            q, k, v, out, ranges, range_counts, bias, part, prior_o, prior_lse, scale * _LOG2E,
            H, Lq, Lk, R, block_q, lo, hi, n_whole, n_split,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *prior_strides,
            D=D, BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=key_bias is not None, HAS_PRIOR=prior is not None,
            SPLITS=splits, R_BLOCK=r_block if splits else 1,
            num_warps=launch["num_warps"], num_stages=launch["num_stages"],
            **({"grid": (1,)} if warmup else {}),
        )

    variant = (q.device, q.dtype, D, bm, bn, launch["num_warps"], launch["num_stages"],
               key_bias is not None, prior is not None, r_block)
    n_whole, n_split = split_items(n_items, num_splits, wave,
                                   lambda: device_wave(variant, lambda: run(0, 2, warmup=True)))
    if n_whole < n_items:
        shares = (n_items - n_whole) * n_split
        part = torch.empty(shares * bm * (D + 1), dtype=torch.float32, device=q.device)
    run(n_whole, n_split)
    if n_whole < n_items:
        _combine_splits_kernel[(n_items - n_whole,)](
            part, part[shares * bm * D:], out, H, Lq, block_q, nqb, n_whole, n_split, *out.stride(),
            D=D, BLOCK_M=bm, num_warps=4,
        )
    return out


def block_sparse_attention_auto(q: Tensor, *args, block_q: int = 64, **kwargs) -> Tensor:
    """The kernel where ``use_kernel`` and ``kernel_supports`` allow, else the twin."""
    fits = isinstance(q, Tensor) and kernel_supports(q, block_q)
    fn = block_sparse_attention if use_kernel(q, fits) else block_sparse_attention_torch
    return fn(q, *args, block_q=block_q, **kwargs)
