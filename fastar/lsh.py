"""Sign-of-random-projection LSH (FAST-AR §5.3): the buckets AnnSA sorts the history by and
AnnCA selects prompt tokens with."""
from __future__ import annotations

import torch


class LSH:
    """Sign-of-random-projection hashing: ``bits`` Gaussian planes per layer and head, drawn
    once from ``seed`` on the host (so every device gets the same planes). The methods take one
    layer's planes (``self.planes[layer]``, [H, D, bits]) so a captured plan can be fed any layer's."""

    def __init__(self, bits: int, probes: int, *, num_layers: int, num_heads: int, head_dim: int, seed: int,
                 device):
        g = torch.Generator().manual_seed(seed)
        self.planes = torch.randn(num_layers, num_heads, head_dim, bits, generator=g).to(device)
        self.bits, self.probes = bits, probes
        self.weights = (1 << torch.arange(bits, device=device))

    @staticmethod
    def project(planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, H, D] -> projections [B, H, L, bits] (in x's dtype, fp32 out)."""
        return torch.einsum("blhd,hdk->bhlk", x, planes.to(x.dtype)).float()

    def codes(self, proj: torch.Tensor) -> torch.Tensor:
        """Bucket id of each projection row: the packed sign bits (int64)."""
        return ((proj > 0).long() * self.weights).sum(-1)

    def hash(self, planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Bucket ids [B, H, L] of x [B, L, H, D]."""
        return self.codes(self.project(planes, x))

    def probe_codes(self, planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Buckets each row of x [B, L, H, D] probes: its own, then its code with each of its
        ``probes`` smallest-margin bits flipped. Returns [B, H, L, 1 + probes]."""
        proj = self.project(planes, x)
        code = self.codes(proj)
        if not self.probes:
            return code[..., None]
        flip = proj.abs().topk(self.probes, dim=-1, largest=False).indices  # least certain bits
        return torch.cat([code[..., None], code[..., None] ^ (1 << flip)], dim=-1)
