"""The plan format: which keys each query block of block-sparse attention reads.

Planners (``kernels/quant_select.py``, :func:`dense_ranges`) write plans; the attention
(``kernels/block_sparse_attention.py``) reads them. Queries ``[B, H, Lq]`` are cut into ``nqb =
ceil(Lq / block_q)`` blocks of ``block_q`` consecutive queries; a plan is ``ranges [B, H, nqb, R,
2]`` and ``range_counts [B, H, nqb]``, both int32, and query block ``i`` of head ``(b, h)`` reads::

    keys(b, h, i) = U_{r < range_counts[b, h, i]} [ranges[b, h, i, r, 0], ranges[b, h, i, r, 1])

- Ranges are half-open ``(start, end)`` with ``0 <= start <= end <= Lk``; they may be empty,
  unsorted and unaligned. They must **not overlap**: a key covered twice counts twice.
- Only the first ``range_counts[b, h, i]`` of the ``R`` slots are read; the rest may hold anything.

A plan's shapes are checked for free (:func:`check_plan`); its values only with a host sync
(:func:`validate_plan`), which the kernel path must not do: a sync stalls the launch queue, and
the rollout captures forwards as CUDA graphs (docs/engine.md).
"""
from __future__ import annotations

import operator

import torch
from torch import Tensor

__all__ = ["check_block_q", "check_plan", "dense_ranges", "n_query_blocks", "range_blocks", "range_reads",
           "runs_to_ranges", "validate_plan"]


def n_query_blocks(Lq: int, block_q: int) -> int:
    """Number of query blocks, ``ceil(Lq / block_q)``."""
    return -(-Lq // block_q)


def check_block_q(block_q) -> int:
    """``block_q`` as an int >= 1 (it fixes the query blocks a plan refers to)."""
    try:
        block_q = operator.index(block_q)
    except TypeError:
        raise ValueError(f"block_q must be an int, got {type(block_q).__name__}") from None
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    return block_q


def check_plan(ranges: Tensor, range_counts: Tensor, B: int, H: int, Lq: int, block_q: int) -> tuple[int, int]:
    """A plan's dtypes and shapes for queries [B, H, Lq] in blocks of ``block_q`` (no host sync);
    returns ``(nqb, R)``."""
    nqb = n_query_blocks(Lq, block_q)
    if ranges.dtype != torch.int32:
        raise ValueError(f"ranges must be int32, got {ranges.dtype}")
    if ranges.ndim != 5 or ranges.shape[:3] != (B, H, nqb) or ranges.shape[4] != 2:
        raise ValueError(
            f"ranges must have shape [B, H, n_qblocks, R, 2] = [{B}, {H}, {nqb}, R, 2] "
            f"(n_qblocks = ceil(Lq={Lq} / block_q={block_q})), got {tuple(ranges.shape)}"
        )
    if range_counts.dtype != torch.int32:
        raise ValueError(f"range_counts must be int32, got {range_counts.dtype}")
    if tuple(range_counts.shape) != (B, H, nqb):
        raise ValueError(
            f"range_counts must have shape [B, H, n_qblocks] = [{B}, {H}, {nqb}], "
            f"got {tuple(range_counts.shape)}"
        )
    return nqb, ranges.shape[3]


def validate_plan(
    ranges: Tensor,
    range_counts: Tensor,
    Lk: int,
    key_bias: Tensor | None = None,
) -> None:
    """Check the *values* of a plan; raises ValueError. Syncs with the host: not for hot paths.

    Counts in ``[0, R]``; every used range ``0 <= start <= end <= Lk``; ``key_bias`` without
    NaN or ``+inf``.
    """
    R = ranges.shape[-2]
    if range_counts.numel():
        lo, hi = int(range_counts.min()), int(range_counts.max())
        if lo < 0 or hi > R:
            raise ValueError(f"range_counts must lie in [0, R={R}], got values in [{lo}, {hi}]")
        used = torch.arange(R, device=ranges.device) < range_counts.unsqueeze(-1).long()
        starts, ends = ranges[..., 0][used], ranges[..., 1][used]
        if starts.numel():
            if int(starts.min()) < 0:
                raise ValueError(f"ranges: start must be >= 0, got {int(starts.min())}")
            if int(ends.max()) > Lk:
                raise ValueError(f"ranges: end must be <= Lk={Lk}, got {int(ends.max())}")
            if bool((starts > ends).any()):
                raise ValueError("ranges: start must be <= end (a reversed range is a planning bug)")
    if key_bias is not None and key_bias.numel():
        if bool(torch.isnan(key_bias).any()) or bool((key_bias == float("inf")).any()):
            raise ValueError("key_bias must be finite or -inf (found NaN or +inf)")


def dense_ranges(
    B: int, H: int, Lq: int, Lk: int, block_q: int, *, device=None
) -> tuple[Tensor, Tensor]:
    """The plan "every query block reads all keys", (0, Lk): ``(ranges [B, H, nqb, 1, 2],
    range_counts)``, int32. Attention with it is dense attention with ``key_bias`` as the mask."""
    for name, val in (("B", B), ("H", H), ("Lq", Lq), ("Lk", Lk)):
        if operator.index(val) < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    block_q = check_block_q(block_q)
    nqb = n_query_blocks(Lq, block_q)
    ranges = torch.zeros(B, H, nqb, 1, 2, dtype=torch.int32, device=device)
    ranges[..., 1] = Lk
    counts = torch.ones(B, H, nqb, dtype=torch.int32, device=device)
    return ranges, counts


def runs_to_ranges(sel: Tensor, starts: Tensor, ends: Tensor, slots: int, *, sink: int, chunk_start: int,
                   chunk_stop: int) -> tuple[Tensor, Tensor]:
    """A plan from selected segments: ``sel`` [B, H, nqb, n] marks each query block's segments
    (``starts`` / ``ends``, same shape, their key bounds, in key order); consecutive selected
    segments form one run, read as ``[starts[first], ends[last])``. Slot 0 is the sink ``[0,
    sink)``, slot 1 the open chunk, then one slot per run; returns (ranges [B, H, nqb, slots, 2],
    counts [B, H, nqb]), int32, slots past a block's count zero."""
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


def range_reads(ranges: Tensor, counts: Tensor) -> Tensor:
    """Keys each query block of a plan reads: its first ``counts`` ranges' lengths summed (int32 [B, H, nqb])."""
    used = torch.arange(ranges.shape[-2], device=ranges.device) < counts[..., None]
    return ((ranges[..., 1] - ranges[..., 0]).clamp_min(0) * used).sum(-1, dtype=torch.int32)


def range_blocks(ranges: Tensor, counts: Tensor, start: int, n_keys: int, key_block: int,
                 merge: int = 1) -> tuple[Tensor, Tensor]:
    """A plan as lists of key blocks, the form FlashAttention-4's block sparsity reads: keys
    ``[start, start + n_keys)`` cut into blocks of ``key_block``; each query block's ranges (which
    lie on those blocks' bounds, a partial last block included) give the blocks they cover, and
    ``merge`` consecutive query blocks share one list, the union of theirs (a coarser query tile).
    Returns (block counts [B, H, ceil(nqb / merge)], block indices [B, H, ceil(nqb / merge), nkb]),
    int32, each list ascending (FA4 masks the sequence's end on the last one only), slots past a
    count holding the last block. No host sync."""
    b, h, nqb, r, _ = ranges.shape
    nkb = -(-n_keys // key_block)
    used = torch.arange(r, device=ranges.device) < counts[..., None]
    first = ((ranges[..., 0] - start).clamp(0, n_keys) // key_block).long()
    last = (-(-(ranges[..., 1] - start).clamp(0, n_keys) // key_block)).long()
    live = used & (last > first)
    edges = torch.zeros(b, h, nqb, nkb + 1, dtype=torch.int32, device=ranges.device)
    one = live.to(torch.int32)
    edges.scatter_add_(-1, torch.where(live, first, nkb), one).scatter_add_(-1, torch.where(live, last, nkb), -one)
    covered = edges[..., :nkb].cumsum(-1) > 0
    if merge > 1:
        pad = -nqb % merge
        covered = torch.nn.functional.pad(covered, (0, 0, 0, pad)).view(b, h, -1, merge, nkb).any(-2)
    idx = torch.where(covered, torch.arange(nkb, device=ranges.device), nkb).sort(-1).values
    return covered.sum(-1, dtype=torch.int32), idx.clamp_max(nkb - 1).to(torch.int32)
