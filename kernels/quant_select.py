"""AnnSA 'quant' planning: from key-block scores to each query block's key ranges, as one Triton kernel.

Why: in PyTorch this is a top-k, a sort, a gather and a dozen small ops turning picks into runs and
runs into slots, costing more than the scoring; one program per query block does
it in registers.

Semantics (the twin defines them). For each row ``score[b, h, i, :]`` (one query block's score of
every key block; ``held[b, h, j]``: whether key block ``j`` holds any key):

- the ``top`` best-scoring key blocks are picked; among equal scores the lower block index wins
  (``-0.0`` equals ``0.0``; scores are never NaN);
- picked blocks that hold keys form runs of consecutive block indices; run ``r`` (in index
  order) becomes the range ``[rows_start + first * key_block, min(rows_start + (last + 1) *
  key_block, rows_stop))`` in slot ``2 + r``; picked empty blocks read nothing and take no slot;
- slot 0 is the sink ``[0, sink)``, slot 1 the open chunk ``[chunk_start, chunk_stop)``;
  ``counts = 2 + runs``; slots past ``counts`` are left as zeros.

With ``mass`` (top-p), a row also picks the fewest best blocks whose share of the query block's
attention mass, the sink and open chunk counted in, reaches ``mass``: the union of both picks.
Scores are log masses: with ``fixed[b, h, i]`` the log mass of the keys every plan reads and ``w_j
= exp(score_j)`` over held blocks, the row needs ``mass * (exp(fixed) + sum w) - exp(fixed)``; ``t``
is the best score at which held blocks scoring ``>= t`` carry that much, all picked (ties
included); ``mass = 1`` picks every held block (no rounding decides it), a row needing nothing
only its ``top``. Why: a query block whose sink and own chunk hold most of its mass reads few
history blocks, a diffuse one many, so all keep about the same recall.

Output: a plan (``kernels/plan.py``), ``ranges [B, H, nqb, 2 + slots(top, nkb, mass), 2]`` and
``counts [B, H, nqb]``, int32; with ``reads`` (int32 [B, H, nqb]) also each query block's keys read
(``plan.range_reads``, AnnSA's density telemetry) at no extra launch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, use_kernel
from .plan import range_reads, runs_to_ranges

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["quant_select", "quant_select_auto", "quant_select_torch", "slots"]


def _check_reads(reads, shape):
    if reads is not None and (tuple(reads.shape) != shape or reads.dtype != torch.int32 or not reads.is_contiguous()):
        raise ValueError(f"reads must be a contiguous int32 {list(shape)}, got {reads.dtype} {tuple(reads.shape)}"
                         f"{'' if reads.is_contiguous() else ' (strided)'}")


def slots(top: int, nkb: int, mass: float | None) -> int:
    """Range slots past the sink's and the chunk's: at most a run per picked block; with ``mass``,
    any number of blocks, in at most ceil(nkb / 2) runs."""
    return top if mass is None else max(top, (nkb + 1) // 2)


def _check(score, held, top, key_block, mass=None, fixed=None):
    if score.ndim != 4 or score.dtype != torch.float32:
        raise ValueError(f"score must be float32 [B, H, nqb, n_key_blocks], got {score.dtype} {tuple(score.shape)}")
    b, h, nqb, nkb = score.shape
    if tuple(held.shape) != (b, h, nkb) or held.dtype != torch.bool:
        raise ValueError(f"held must be bool [B, H, n_key_blocks] = [{b}, {h}, {nkb}], got {held.dtype} "
                         f"{tuple(held.shape)}")
    if not 1 <= top <= nkb:
        raise ValueError(f"top must lie in [1, n_key_blocks={nkb}], got {top}")
    if key_block < 1:
        raise ValueError(f"key_block must be >= 1, got {key_block}")
    if mass is not None:
        if isinstance(mass, bool) or not isinstance(mass, (int, float)) or not 0.0 <= mass <= 1.0:
            raise ValueError(f"mass must lie in [0, 1], got {mass!r}")
        if fixed is None or tuple(fixed.shape) != (b, h, nqb) or fixed.dtype != torch.float32:
            raise ValueError(f"mass needs fixed, float32 [B, H, nqb] = [{b}, {h}, {nqb}], got "
                             f"{None if fixed is None else (fixed.dtype, tuple(fixed.shape))}")
    return b, h, nqb, nkb


def quant_select_torch(score: Tensor, held: Tensor, top: int, *, key_block: int, rows_start: int, rows_stop: int,
                       sink: int, chunk_start: int, chunk_stop: int, mass: float | None = None,
                       fixed: Tensor | None = None, reads: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference twin: (ranges [B, H, nqb, 2 + slots(top, nkb, mass), 2], counts [B, H, nqb]), int32."""
    b, h, nqb, nkb = _check(score, held, top, key_block, mass, fixed)
    _check_reads(reads, (b, h, nqb))
    ranked, order = torch.sort(score + 0.0, dim=-1, descending=True, stable=True)  # + 0.0: -0.0 == 0.0
    run = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order[..., :top], True) & held[:, :, None]
    if mass is not None:
        held_row = held[:, :, None].expand_as(score)
        s = torch.where(held_row, score + 0.0, float("-inf"))
        m = torch.maximum(fixed, s.amax(-1))
        w = torch.exp(s - m[..., None])
        e_fixed = torch.exp(fixed - m)
        need = mass * (e_fixed + w.sum(-1)) - e_fixed if mass < 1 else torch.full_like(fixed, float("inf"))
        s_sorted, idx = torch.sort(s, dim=-1, descending=True, stable=True)
        past = (w.gather(-1, idx).cumsum(-1) < need[..., None]).sum(-1, keepdim=True).clamp(max=nkb - 1)
        t_mass = s_sorted.gather(-1, past)
        use = (need[..., None] > 0) & (t_mass <= ranked[..., top - 1:top])  # the mass pick reaches past the top-th
        run = torch.where(use, held_row & (score + 0.0 >= t_mass), run)
    start = rows_start + torch.arange(nkb, device=score.device, dtype=torch.int32) * key_block
    end = torch.clamp(start + key_block, max=rows_stop)
    ranges, counts = runs_to_ranges(run, start.expand_as(score), end.expand_as(score), 2 + slots(top, nkb, mass),
                                    sink=sink, chunk_start=chunk_start, chunk_stop=chunk_stop)
    if reads is not None:
        reads.copy_(range_reads(ranges, counts))
    return ranges, counts


if HAS_TRITON:

    @triton.jit
    def _order_key(x):
        """Float -> int64 in [0, 2**32) with the same order (-0.0 counted as 0.0)."""
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648

    @triton.jit(do_not_specialize=["H", "NQB", "NKB", "TOP", "key_block", "rows_start", "rows_stop", "sink",
                                   "chunk_start", "chunk_stop", "mass", "SLOTS"])
    def _quant_select_kernel(s_ptr, held_ptr, f_ptr, r_ptr, c_ptr, rd_ptr, H, NQB, NKB, TOP, key_block, rows_start,
                             rows_stop, sink, chunk_start, chunk_stop, mass, SLOTS, CHUNK: tl.constexpr,
                             WHOLE_ROW: tl.constexpr, MASS: tl.constexpr, READS: tl.constexpr):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        row = pid_bh.to(tl.int64) * NQB + pid_m
        s_row = s_ptr + row * NKB
        h_row = held_ptr + pid_bh.to(tl.int64) * NKB
        offs = tl.arange(0, CHUNK)
        # 1. the TOP-th largest key: bit by bit, the largest t with count(key >= t) >= TOP; with MASS,
        # also the largest t_m whose held blocks with key >= t_m weigh need_m
        t = tl.zeros([], dtype=tl.int64)
        t_m = tl.zeros([], dtype=tl.int64)
        if WHOLE_ROW:  # the row fits one chunk: loaded once, the 32 rounds count in registers
            ok = offs < NKB
            row_s = tl.load(s_row + offs, mask=ok, other=float("-inf"))
            row_key = _order_key(row_s)
            for i in range(32):
                cand = t + (tl.full([], 1, tl.int64) << (31 - i))
                t = tl.where(tl.sum(((row_key >= cand) & ok).to(tl.int32), 0) >= TOP, cand, t)
            if MASS:
                row_held = ok & (tl.load(h_row + offs, mask=ok, other=0) != 0)
                fixed = tl.load(f_ptr + row)
                top_s = tl.maximum(fixed, tl.max(tl.where(row_held, row_s, float("-inf")), 0))
                w = tl.where(row_held, tl.exp(row_s - top_s), 0.0)
                e_fixed = tl.exp(fixed - top_s)
                need_m = tl.where(mass >= 1.0, float("inf"), mass * (e_fixed + tl.sum(w, 0)) - e_fixed)
                for i in range(32):
                    cand = t_m + (tl.full([], 1, tl.int64) << (31 - i))
                    t_m = tl.where(tl.sum(tl.where(row_key >= cand, w, 0.0), 0) >= need_m, cand, t_m)
        else:
            for i in range(32):
                cand = t + (tl.full([], 1, tl.int64) << (31 - i))
                n = tl.zeros([], dtype=tl.int32)
                for j0 in range(0, NKB, CHUNK):
                    j = j0 + offs
                    key = _order_key(tl.load(s_row + j, mask=j < NKB, other=float("-inf")))
                    n += tl.sum(((key >= cand) & (j < NKB)).to(tl.int32), 0)
                t = tl.where(n >= TOP, cand, t)
            if MASS:
                fixed = tl.load(f_ptr + row)
                top_s = fixed
                for j0 in range(0, NKB, CHUNK):
                    j = j0 + offs
                    hj = (j < NKB) & (tl.load(h_row + j, mask=j < NKB, other=0) != 0)
                    top_s = tl.maximum(top_s, tl.max(tl.where(hj, tl.load(s_row + j, mask=hj, other=0.0),
                                                              float("-inf")), 0))
                e_fixed = tl.exp(fixed - top_s)
                total = e_fixed
                for j0 in range(0, NKB, CHUNK):
                    j = j0 + offs
                    hj = (j < NKB) & (tl.load(h_row + j, mask=j < NKB, other=0) != 0)
                    total += tl.sum(tl.where(hj, tl.exp(tl.load(s_row + j, mask=hj, other=0.0) - top_s), 0.0), 0)
                need_m = tl.where(mass >= 1.0, float("inf"), mass * total - e_fixed)
                for i in range(32):
                    cand = t_m + (tl.full([], 1, tl.int64) << (31 - i))
                    wsum = tl.zeros([], dtype=tl.float32)
                    for j0 in range(0, NKB, CHUNK):
                        j = j0 + offs
                        hj = (j < NKB) & (tl.load(h_row + j, mask=j < NKB, other=0) != 0)
                        sj = tl.load(s_row + j, mask=hj, other=0.0)
                        wsum += tl.sum(tl.where(hj & (_order_key(sj) >= cand), tl.exp(sj - top_s), 0.0), 0)
                    t_m = tl.where(wsum >= need_m, cand, t_m)
        if MASS:  # the union of both picks: the mass pick where it reaches past the TOP-th key
            use_m = (need_m > 0) & (t_m <= t)
            t = tl.where(use_m, t_m, t)
        # 2. ties at t: the first `need` by block index; picked blocks that hold keys form runs
        n_above = tl.zeros([], dtype=tl.int32)
        for j0 in range(0, NKB, CHUNK):
            j = j0 + offs
            key = _order_key(tl.load(s_row + j, mask=j < NKB, other=float("-inf")))
            n_above += tl.sum(((key > t) & (j < NKB)).to(tl.int32), 0)
        need = TOP - n_above
        if MASS:  # every tie at t_m is picked
            need = tl.where(use_m, NKB, need)
        r_row = r_ptr + row * (2 + SLOTS) * 2
        eq_before = tl.zeros([], dtype=tl.int32)  # ties at t in earlier chunks
        runs = tl.zeros([], dtype=tl.int32)       # runs started in earlier chunks
        n_read = tl.zeros([], dtype=tl.int32)     # history keys in the runs
        for j0 in range(0, NKB, CHUNK):
            j = j0 + offs
            ok = j < NKB
            key = _order_key(tl.load(s_row + j, mask=ok, other=float("-inf")))
            eq = ((key == t) & ok).to(tl.int32)
            rank = eq_before + tl.cumsum(eq, 0) - eq                 # ties before j
            pick = ok & ((key > t) | ((eq > 0) & (rank < need)))
            run = pick & (tl.load(h_row + j, mask=ok, other=0) != 0)
            # the same for the neighbours j - 1 and j + 1, from their own loads
            okp = ok & (j > 0)
            keyp = _order_key(tl.load(s_row + j - 1, mask=okp, other=float("-inf")))
            eqp = ((keyp == t) & okp).to(tl.int32)
            runp = okp & ((keyp > t) | ((eqp > 0) & (rank - eqp < need)))
            runp = runp & (tl.load(h_row + j - 1, mask=okp, other=0) != 0)
            okn = j + 1 < NKB
            keyn = _order_key(tl.load(s_row + j + 1, mask=okn, other=float("-inf")))
            eqn = ((keyn == t) & okn).to(tl.int32)
            runn = okn & ((keyn > t) | ((eqn > 0) & (rank + eq < need)))
            runn = runn & (tl.load(h_row + j + 1, mask=okn, other=0) != 0)
            first = run & ~runp
            last = run & ~runn
            slot = 2 + runs + tl.cumsum(first.to(tl.int32), 0) - 1  # the run's slot (at its first and last block)
            start = rows_start + j * key_block
            tl.store(r_row + slot * 2, start, mask=first)
            tl.store(r_row + slot * 2 + 1, tl.minimum(start + key_block, rows_stop), mask=last)
            runs += tl.sum(first.to(tl.int32), 0)
            eq_before += tl.sum(eq, 0)
            if READS:
                n_read += tl.sum(tl.where(run, tl.minimum(start + key_block, rows_stop) - start, 0), 0)
        tl.store(r_row, 0)
        tl.store(r_row + 1, sink)
        tl.store(r_row + 2, chunk_start)
        tl.store(r_row + 3, chunk_stop)
        tl.store(c_ptr + row, 2 + runs)
        if READS:
            tl.store(rd_ptr + row, n_read + sink + chunk_stop - chunk_start)


def quant_select(score: Tensor, held: Tensor, top: int, *, key_block: int, rows_start: int, rows_stop: int, sink: int,
                 chunk_start: int, chunk_stop: int, mass: float | None = None, fixed: Tensor | None = None,
                 reads: Tensor | None = None, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract. ``chunk``: key blocks held in registers at a time (a
    power of two). By default a row of up to 4096 key blocks is held whole, so the 32 counting
    rounds never reload it; longer rows stream in chunks of 1024."""
    if not HAS_TRITON:
        raise RuntimeError("quant_select needs triton, which is not importable")
    b, h, nqb, nkb = _check(score, held, top, key_block, mass, fixed)
    _check_reads(reads, (b, h, nqb))
    check_triton_runs_on(score)
    ranges = torch.zeros(b, h, nqb, 2 + slots(top, nkb, mass), 2, dtype=torch.int32, device=score.device)
    counts = torch.empty(b, h, nqb, dtype=torch.int32, device=score.device)
    if chunk is None:
        chunk = max(16, triton.next_power_of_2(nkb)) if nkb <= 4096 else 1024
    if counts.numel():
        f = fixed.contiguous() if mass is not None else counts  # not read without MASS
        _quant_select_kernel[(nqb, b * h)](score.contiguous(), held.contiguous().view(torch.int8), f, ranges, counts,
                                           reads if reads is not None else counts, h, nqb, nkb, top, key_block,
                                           rows_start, rows_stop, sink, chunk_start, chunk_stop, float(mass or 0.0),
                                           slots(top, nkb, mass), CHUNK=chunk, WHOLE_ROW=nkb <= chunk,
                                           MASS=mass is not None, READS=reads is not None, num_warps=4)
    return ranges, counts


def quant_select_auto(score: Tensor, held: Tensor, top: int, **kw) -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs, else the twin."""
    return (quant_select if use_kernel(score) else quant_select_torch)(score, held, top, **kw)
