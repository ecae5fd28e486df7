"""CUDA-graph replay of a rollout's chunks and clean passes (``ReplayGraph``)."""
from __future__ import annotations

import threading
from typing import Callable

import torch

CAPTURE_LOCK = threading.Lock()
"""Held while a graph captures. Work beside the sampling in another thread (a chunk decoded while the next
samples) holds it too: the allocator freeing its cache, or a synchronizing call, breaks a capture under way."""


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
            with CAPTURE_LOCK, torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = fn(*inputs)  # records; the replay below computes
            self.key, self.graph, self.inputs, self.out = key, graph, inputs, out
        fill(*self.inputs)
        self.graph.replay()
        return self.out
