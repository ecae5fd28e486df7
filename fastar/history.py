"""The clean latents a rollout keeps: every frame, or only those a later prompt switch re-encodes."""
from __future__ import annotations

from typing import Callable

import torch

from .errors import FastARError


class History:
    """The clean latents a rollout has made, as far as it keeps them: every frame (``keep``, in one
    [B, C, frames, h, w] tensor, ``out``), else only those a later prompt switch re-encodes, which
    ``needed(stop)`` names once the frames before ``stop`` are made: the first frames of the latents to
    hold (the start frames, the sink's chunks and the most recent chunks the cache reaches:
    ``Rollout.held_for_switches``), or None once no switch is left."""

    def __init__(self, shape: tuple[int, ...], device, keep: bool, needed: Callable[[int], set[int] | None]):
        self.keep, self.needed = keep, needed
        self.out = torch.empty(shape, device=device) if keep else None
        self.held: dict[int, torch.Tensor] = {}  # first frame -> latents, without ``keep``

    def add(self, start: int, x0: torch.Tensor) -> None:
        stop = start + x0.shape[2]
        if self.keep:
            self.out[:, :, start:stop] = x0
            return
        self.held[start] = x0
        needed = self.needed(stop)
        if needed is None:
            self.held.clear()
            return
        for first in [f for f in self.held if f not in needed]:
            del self.held[first]

    def frames(self, a: int, b: int) -> torch.Tensor:
        """Frames [a, b), which must be held."""
        if self.keep:
            return self.out[:, :, a:b]
        parts, frame = [], a
        while frame < b:
            if frame not in self.held:
                raise FastARError(f"frame {frame} is not held (the history keeps what a prompt switch re-encodes)")
            parts.append(self.held[frame])
            frame += parts[-1].shape[2]
        return torch.cat(parts, 2)[:, :, :b - a]
