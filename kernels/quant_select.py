"""AnnSA 'quant' planning: from key-block scores to each query block's key ranges, as one Triton kernel.

Why: in PyTorch this step is a top-k, a sort of the picked indices, a gather and a dozen small
ops that turn picks into runs and runs into range slots; on the H200 those kernels cost more
than the scoring itself (bench/results/chunk_profile.json). One program per query block does it
all in registers.

Semantics (the twin defines them). For each row ``score[b, h, i, :]`` (one query block's score of
every key block; ``held[b, h, j]`` says whether key block ``j`` holds any key):

- the ``top`` best-scoring key blocks are picked; among equal scores the lower block index wins
  (``-0.0`` equals ``0.0``; scores are never NaN);
- picked blocks that hold keys form runs of consecutive block indices; run ``r`` (in index
  order) becomes the range ``[rows_start + first * key_block, min(rows_start + (last + 1) *
  key_block, rows_stop))`` in slot ``2 + r``; picked empty blocks read nothing and take no slot;
- slot 0 is the sink ``[0, sink)``, slot 1 the open chunk ``[chunk_start, chunk_stop)``;
  ``counts = 2 + runs``; slots past ``counts`` are left as zeros.

Output: ``ranges [B, H, nqb, 2 + top, 2]`` and ``counts [B, H, nqb]`` (int32), the plan format of
``kernels/block_sparse_attention.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, triton_runs_on

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["quant_select", "quant_select_auto", "quant_select_torch", "runs_to_ranges"]


def runs_to_ranges(sel: Tensor, starts: Tensor, ends: Tensor, slots: int, *, sink: int, chunk_start: int,
                   chunk_stop: int) -> tuple[Tensor, Tensor]:
    """The plan format from selected segments: ``sel`` [B, H, nqb, n] marks each query block's
    segments (``starts`` / ``ends``, same shape, their key bounds, in key order); consecutive
    selected segments form one run, read as ``[starts[first], ends[last])``. Slot 0 is the sink
    ``[0, sink)``, slot 1 the open chunk, then one slot per run; returns (ranges [B, H, nqb,
    slots, 2], counts [B, H, nqb]), int32, slots past a block's count zero."""
    b, h, nqb, _ = sel.shape
    first = sel & ~torch.nn.functional.pad(sel, (1, 0))[..., :-1]
    last = sel & ~torch.nn.functional.pad(sel, (0, 1))[..., 1:]
    ranges = torch.zeros(b, h, nqb, slots + 1, 2, dtype=torch.int32, device=sel.device)  # last slot: dump
    for col, flags, edge in ((0, first, starts), (1, last, ends)):
        slot = torch.where(flags, 1 + torch.cumsum(flags, -1), slots)
        ranges[..., col].scatter_(-1, slot, edge.to(torch.int32))
    ranges[..., 0, 1] = sink
    ranges[..., 1, 0], ranges[..., 1, 1] = chunk_start, chunk_stop
    return ranges[..., :slots, :], (2 + first.sum(-1)).to(torch.int32)


def _check(score, held, top, key_block):
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
    return b, h, nqb, nkb


def quant_select_torch(score: Tensor, held: Tensor, top: int, *, key_block: int, rows_start: int, rows_stop: int,
                       sink: int, chunk_start: int, chunk_stop: int) -> tuple[Tensor, Tensor]:
    """Reference twin: (ranges [B, H, nqb, 2 + top, 2], counts [B, H, nqb]), int32."""
    b, h, nqb, nkb = _check(score, held, top, key_block)
    order = torch.sort(score + 0.0, dim=-1, descending=True, stable=True).indices[..., :top]  # + 0.0: -0.0 == 0.0
    run = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order, True) & held[:, :, None]
    start = rows_start + torch.arange(nkb, device=score.device, dtype=torch.int32) * key_block
    end = torch.clamp(start + key_block, max=rows_stop)
    return runs_to_ranges(run, start.expand_as(score), end.expand_as(score), 2 + top, sink=sink,
                          chunk_start=chunk_start, chunk_stop=chunk_stop)


if HAS_TRITON:

    @triton.jit
    def _order_key(x):
        """Float -> int64 in [0, 2**32) with the same order (-0.0 counted as 0.0)."""
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648

    @triton.jit(do_not_specialize=["H", "NQB", "NKB", "TOP", "key_block", "rows_start", "rows_stop", "sink",
                                   "chunk_start", "chunk_stop"])
    def _quant_select_kernel(s_ptr, held_ptr, r_ptr, c_ptr, H, NQB, NKB, TOP, key_block, rows_start, rows_stop, sink,
                             chunk_start, chunk_stop, CHUNK: tl.constexpr, WHOLE_ROW: tl.constexpr):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        row = pid_bh.to(tl.int64) * NQB + pid_m
        s_row = s_ptr + row * NKB
        h_row = held_ptr + pid_bh.to(tl.int64) * NKB
        offs = tl.arange(0, CHUNK)
        # 1. the TOP-th largest key: bit by bit, the largest t with count(key >= t) >= TOP
        t = tl.zeros([], dtype=tl.int64)
        if WHOLE_ROW:  # the row fits one chunk: loaded once, the 32 rounds count in registers
            ok = offs < NKB
            row_key = _order_key(tl.load(s_row + offs, mask=ok, other=float("-inf")))
            for i in range(32):
                cand = t + (tl.full([], 1, tl.int64) << (31 - i))
                t = tl.where(tl.sum(((row_key >= cand) & ok).to(tl.int32), 0) >= TOP, cand, t)
        else:
            for i in range(32):
                cand = t + (tl.full([], 1, tl.int64) << (31 - i))
                n = tl.zeros([], dtype=tl.int32)
                for j0 in range(0, NKB, CHUNK):
                    j = j0 + offs
                    key = _order_key(tl.load(s_row + j, mask=j < NKB, other=float("-inf")))
                    n += tl.sum(((key >= cand) & (j < NKB)).to(tl.int32), 0)
                t = tl.where(n >= TOP, cand, t)
        # 2. ties at t: the first `need` by block index; picked blocks that hold keys form runs
        n_above = tl.zeros([], dtype=tl.int32)
        for j0 in range(0, NKB, CHUNK):
            j = j0 + offs
            key = _order_key(tl.load(s_row + j, mask=j < NKB, other=float("-inf")))
            n_above += tl.sum(((key > t) & (j < NKB)).to(tl.int32), 0)
        need = TOP - n_above
        r_row = r_ptr + row * (2 + TOP) * 2
        eq_before = tl.zeros([], dtype=tl.int32)  # ties at t in earlier chunks
        runs = tl.zeros([], dtype=tl.int32)       # runs started in earlier chunks
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
        tl.store(r_row, 0)
        tl.store(r_row + 1, sink)
        tl.store(r_row + 2, chunk_start)
        tl.store(r_row + 3, chunk_stop)
        tl.store(c_ptr + row, 2 + runs)


def quant_select(score: Tensor, held: Tensor, top: int, *, key_block: int, rows_start: int, rows_stop: int, sink: int,
                 chunk_start: int, chunk_stop: int, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract; one program per query block. ``chunk``: key blocks
    held in registers at a time (a power of two; any row length works). By default a row of up
    to 4096 key blocks (240 cached frames of 128-key blocks) is held whole, so the selection's
    32 counting rounds never reload it; longer rows stream in chunks of 1024."""
    if not HAS_TRITON:
        raise RuntimeError("quant_select needs triton, which is not importable")
    b, h, nqb, nkb = _check(score, held, top, key_block)
    check_triton_runs_on(score)
    ranges = torch.zeros(b, h, nqb, 2 + top, 2, dtype=torch.int32, device=score.device)
    counts = torch.empty(b, h, nqb, dtype=torch.int32, device=score.device)
    if chunk is None:
        chunk = max(16, triton.next_power_of_2(nkb)) if nkb <= 4096 else 1024
    if counts.numel():
        _quant_select_kernel[(nqb, b * h)](score.contiguous(), held.contiguous().view(torch.int8), ranges, counts, h, nqb,
                                           nkb, top, key_block, rows_start, rows_stop, sink, chunk_start, chunk_stop,
                                           CHUNK=chunk, WHOLE_ROW=nkb <= chunk, num_warps=4)
    return ranges, counts


def quant_select_auto(score: Tensor, held: Tensor, top: int, **kw) -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs, else the twin."""
    return (quant_select if triton_runs_on(score) else quant_select_torch)(score, held, top, **kw)
