"""AnnCA: approximate-nearest-neighbour sparse cross-attention (FAST-AR §5.4).

Per current frame, prompt tokens sharing an LSH bucket (with probes: a query's least certain
bits flipped) with at least one of the frame's queries are kept; if fewer than ``min_tokens``
survive, the ``min_tokens`` best-scoring tokens (against the frame's mean query) join them.
Each frame's kept tokens are gathered to the front of a per-frame key copy (the prompt is a few
hundred tokens) and attended block-sparse (the attention backend's ``sparse``) with one range ``[0, kept)``.
"""
from __future__ import annotations

import torch

from .backend import Torch
from .config import AnnConfig
from .errors import FastARError
from .lsh import LSH


def _hit_buckets(cands: torch.Tensor, group: torch.Tensor, groups: int, buckets: int) -> torch.Tensor:
    """Bool [B, H, groups, buckets]: which buckets the rows of each group probe.
    cands [B, H, L, P] bucket ids; group [L] or [B, H, L] group of each row."""
    b, h, n, p = cands.shape
    hit = torch.zeros(b, h, groups * buckets, dtype=torch.bool, device=cands.device)
    flat = (group.expand(b, h, n)[..., None] * buckets + cands).reshape(b, h, n * p)
    hit.scatter_(-1, flat, True)
    return hit.view(b, h, groups, buckets)


class AnnCA:
    """Per-frame prompt-token selection for cross-attention."""

    def __init__(self, config: AnnConfig, lsh: LSH, tokens_per_frame: int, num_layers: int, device, backend: Torch):
        self.config, self.lsh, self.tokens_per_frame, self.backend = config, lsh, tokens_per_frame, backend
        self.density = torch.ones(num_layers, device=device)  # prompt tokens kept, last sparse call

    def keep(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Kept prompt tokens per frame: bool [B, H, F, Lc] for q [B, F*tpf, H, D], k [B, Lc, H, D]."""
        b, n, h, d = q.shape
        tpf, lc = self.tokens_per_frame, k.shape[1]
        if n % tpf:
            raise FastARError(f"AnnCA: {n} queries are not whole frames of {tpf} tokens")
        frames = n // tpf
        cands = self.lsh.probe_codes(self.lsh.planes[layer], q)   # [B, H, n, P]
        hit = _hit_buckets(cands, torch.arange(n, device=q.device) // tpf, frames, self.config.buckets)
        code_k = self.lsh.hash(self.lsh.planes[layer], k)          # [B, H, Lc]
        keep = hit.gather(-1, code_k[:, :, None, :].expand(b, h, frames, lc))
        m = min(self.config.min_tokens, lc)
        if m:
            mean_q = q.view(b, frames, tpf, h, d).float().mean(2).permute(0, 2, 1, 3)   # [B, H, F, D]
            score = mean_q @ k.float().permute(0, 2, 3, 1)                              # [B, H, F, Lc]
            best = torch.zeros_like(keep).scatter_(-1, score.topk(m, dim=-1).indices, True)
            keep = keep | (best & (keep.sum(-1, keepdim=True) < m))
        return keep

    def attention(self, layer: int, q, k, v):
        """Cross-attention of q [B, n, H, D] over the kept prompt tokens of each query's frame."""
        keep = self.keep(layer, q, k)
        b, h, frames, lc = keep.shape
        tpf, bq = self.tokens_per_frame, self.config.block_q
        order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)  # kept tokens first
        kept = keep.sum(-1).to(torch.int32)                                  # [B, H, F]
        self.density[layer] = kept.float().mean() / max(lc, 1)
        kt, vt, qt = k.transpose(1, 2), v.transpose(1, 2), q.transpose(1, 2)
        nqb = -(-tpf // bq)
        counts = torch.ones(b, h, nqb, dtype=torch.int32, device=q.device)
        outs = []
        for f in range(frames):
            idx = order[:, :, f, :, None].expand(b, h, lc, kt.shape[-1])
            ranges = torch.zeros(b, h, nqb, 1, 2, dtype=torch.int32, device=q.device)
            ranges[..., 0, 1] = kept[:, :, f, None]
            outs.append(self.backend.sparse(qt[:, :, f * tpf:(f + 1) * tpf].transpose(1, 2),
                                            kt.gather(2, idx).transpose(1, 2), vt.gather(2, idx).transpose(1, 2),
                                            ranges, counts, block_q=bq))
        return torch.cat(outs, dim=1)
