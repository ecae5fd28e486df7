"""CUDA-graph replay of a rollout's chunks and clean passes (``ReplayGraph``)."""
from __future__ import annotations

from typing import Callable

import torch


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
