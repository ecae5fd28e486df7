"""CUDA-graph replay of a rollout's chunks (``ReplayGraph``) and clean passes of given latents into a
rollout's cache (``CleanPasses``: a history re-encoded under a new prompt, a start latent, real video)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .rollout import Rollout


class ReplayGraph:
    """One CUDA graph, the latest key's: ``run`` captures ``fn`` on fixed input buffers the first
    time a key comes, then fills those buffers and replays. Why: a chunk is ~150 layer forwards
    whose Python launches otherwise set the pace, not the GPU."""

    def __init__(self):
        self.key = self.graph = self.inputs = self.out = None

    def run(self, key, make_inputs: Callable, fn: Callable, fill: Callable):
        """``fn(*inputs)`` for the buffers ``make_inputs()`` made, after ``fill(*inputs)``."""
        if self.key is None or self.key != key:
            self.key = self.graph = self.inputs = self.out = None  # free the old graph's memory first
            inputs = make_inputs()
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):  # records; the replay below computes
                out = fn(*inputs)
            self.key, self.graph, self.inputs, self.out = key, graph, inputs, out
        fill(*self.inputs)
        self.graph.replay()
        return self.out


class CleanPasses:
    """Clean passes of given clean latents into a rollout's cache, chunk by chunk: a history re-encoded
    under a new prompt (``Rollout.switch_prompt``), or real video cached (the benchmarks' testbed). On CUDA
    the passes replay from one graph once the attention state's key repeats, as chunks do; successive
    ``run`` calls continue one another."""

    def __init__(self, rollout: "Rollout"):
        self.rollout, self.last, self.graph = rollout, None, ReplayGraph()

    def _pass(self, x0, offset):
        self.rollout.fill_cache(x0, offset)
        self.rollout.cache.join_writes()

    def run(self, latents: torch.Tensor, start: int = 0) -> None:
        """latents [B, C, F, h, w]: chunks (the last may be short: a start latent), the first one's first
        frame ``start``."""
        r = self.rollout
        r.attention.num_steps = len(r.sigmas)
        for i in range(0, latents.shape[2], r.chunk_frames):
            x0, frame = latents[:, :, i:i + r.chunk_frames], start + i
            r.cache.begin_chunk(frame, x0.shape[2])
            key = r.attention.graph_key() if r.cuda_graphs and r.attention.graph_safe else None
            r.attention.begin_clean_pass()
            if key is None or key != self.last:
                self.last = key
                self._pass(x0, frame)
            else:
                self.graph.run(key, lambda: (torch.empty_like(x0), torch.zeros((), dtype=torch.float64, device=r.device)),
                               self._pass, lambda buf, offset: (buf.copy_(x0), offset.fill_(frame)))
            r.cache.commit()
