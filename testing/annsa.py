"""Measurements of AnnSA's plans that the tests and benchmarks share, outside the rollout's path:
how much of the dense attention mass a plan keeps (``recall``) and how many keys it reads
(``plan_density``)."""
from __future__ import annotations

import math

import torch

from ..kernels.plan import range_reads


@torch.no_grad()
def recall(annsa, q, keys, bias, plan, sample_blocks: int = 4, history_only: bool = False) -> torch.Tensor:
    """Dense attention mass inside ``plan`` (``annsa.plan``'s result for q [B, n, H, D] over ``keys``
    [B, Lk, H, D] with TempCache's ``bias``), averaged over the queries of ``sample_blocks`` query blocks
    spread over the chunk (device scalar). ``history_only``: the share of the mass on cached keys (all but
    the open chunk's own, which every plan reads) that the plan keeps: the part of recall the selection
    earns."""
    ranges, counts = plan
    b, n, h, d = q.shape
    nqb, bq, lk = ranges.shape[2], annsa.config.block_q, keys.shape[1]
    n_pick = min(sample_blocks, nqb)
    picks = sorted({round(i * (nqb - 1) / max(n_pick - 1, 1)) for i in range(n_pick)})
    used = torch.arange(ranges.shape[3], device=q.device) < counts[..., None]        # [B, H, nqb, R]
    key = torch.arange(lk, device=q.device)
    chunk = annsa.cache.layout.chunk
    cached = ((key < chunk.start) | (key >= chunk.stop)) if history_only else torch.ones_like(key, dtype=torch.bool)
    mass = []
    for blk in picks:
        r = ranges[:, :, blk]
        inside = ((key >= r[..., 0, None]) & (key < r[..., 1, None]) & used[:, :, blk, :, None]).any(-2)
        for i in range(h):  # one head at a time: [B, r, Lk] logits stay small
            qs = q[:, blk * bq:(blk + 1) * bq, i].float()
            logits = qs @ keys[:, :, i].float().transpose(1, 2) / math.sqrt(d)
            if bias is not None:
                logits = logits + bias[:, i, None]
            p = logits.softmax(-1) * cached
            mass.append(((p * inside[:, i, None]).sum(-1) / p.sum(-1).clamp_min(1e-30)).flatten())
    return torch.cat(mass).mean()


def plan_density(ranges: torch.Tensor, counts: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Mean fraction of the ``num_keys`` keys a query block reads (device scalar)."""
    return range_reads(ranges, counts).float().mean() / max(num_keys, 1)
