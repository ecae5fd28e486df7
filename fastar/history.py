"""The clean latents a rollout keeps: every frame, or only those a later prompt switch re-encodes."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import FastARError

if TYPE_CHECKING:
    from .rollout import Rollout


class History:
    """The clean latents a rollout has made, as far as it keeps them: every frame (``keep``, in one
    [B, C, frames, h, w] tensor, ``out``), else only those a later prompt switch re-encodes: the start
    frames, the sink's chunks and the most recent chunks the cache reaches (``Rollout.recache_chunks``),
    none once no switch is left."""

    def __init__(self, rollout: Rollout, keep: bool):
        self.rollout, self.keep = rollout, keep
        b, ch, _, h, w = rollout.chunk_shape
        self.out = torch.empty(b, ch, rollout.frames, h, w, device=rollout.device) if keep else None
        self.held: dict[int, torch.Tensor] = {}  # first frame -> latents, without ``keep``

    def add(self, start: int, x0: torch.Tensor) -> None:
        stop = start + x0.shape[2]
        if self.keep:
            self.out[:, :, start:stop] = x0
            return
        self.held[start] = x0
        r = self.rollout
        later = [c for c in r.switches if r.chunk_start(c) >= stop]
        if not later:
            self.held.clear()
            return
        sink, recent = r.recache_chunks(stop)  # a later switch reaches no further back than one now
        needed = {r.chunk_start(i) for i in (*sink, *range(recent.start, r.num_chunks))}
        for first in [f for f in self.held if f >= r.first_frame and f not in needed]:
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
