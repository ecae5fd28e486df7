"""Wan's positions: the sinusoidal timestep embedding and 3-axis RoPE (time, height, width), at a
chunk's frames or at any positions (the world model's places in its world)."""
from __future__ import annotations

import torch


def sinusoidal_embedding(dim: int, position: torch.Tensor) -> torch.Tensor:
    half = dim // 2
    position = position.float()
    freqs = torch.pow(10000, -torch.arange(half, device=position.device, dtype=torch.float32) / half)
    angles = torch.outer(position, freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head into (time, height, width) RoPE channels."""
    d = head_dim
    return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)


def rope_at(head_dim: int, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """cos/sin tables [L, head_dim/2, 2] for tokens at (time, height, width) ``positions`` [L, 3]
    (float64; any values, fractional too)."""
    angles = []
    for axis, dim in enumerate(rope_axes(head_dim)):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
        angles.append(torch.outer(positions[:, axis], omega))
    angles = torch.cat(angles, dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def rope_frequencies(head_dim: int, grid: tuple[int, int, int], frame_offset: int | torch.Tensor,
                     device=None, theta: float = 10000.0) -> torch.Tensor:
    """cos/sin tables [L, head_dim/2, 2] for tokens in (frame, row, col) order.

    The temporal index of the chunk's first frame is ``frame_offset``: cached keys keep
    the RoPE of the frame they were written at, as in the causal Wan models. A 0-d tensor
    offset is read on the device, so a CUDA graph of a forward serves every chunk.
    """
    f, h, w = grid
    axes = torch.meshgrid(torch.arange(f, device=device, dtype=torch.float64) + frame_offset,
                          torch.arange(h, device=device, dtype=torch.float64),
                          torch.arange(w, device=device, dtype=torch.float64), indexing="ij")
    return rope_at(head_dim, torch.stack([a.flatten() for a in axes], -1), theta)
