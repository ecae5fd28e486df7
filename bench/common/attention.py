"""The history attention's shapes, inputs, fp32 reference and side-by-side timing
(bench/attention_bench.py, bench/fold_tiles.py): TempCache's layout at Wan 2.1 1.3B's shapes."""
from __future__ import annotations

import math
import statistics

import torch

from . import cuda_ms

TPF, LQ, H, D = 1560, 3 * 1560, 12, 128
FIXED = 6 * TPF  # sink 3 + the open chunk 3


def inputs(frames: int, g):
    lk = FIXED + frames * TPF
    q = torch.randn(1, LQ, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, lk, H, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, lk, H, D, device="cuda", generator=g).bfloat16()
    m = torch.randint(1, 5, (1, H, lk), device="cuda", generator=g).float()
    bias = m.log()
    bias[..., :FIXED] = 0.0
    return q, k, v, bias.contiguous()


def reference(q, k, v, bias, rows, keep=None):
    """fp32 attention of the sampled query rows; ``keep`` [H, rows, Lk] bool restricts the keys."""
    qs = q[:, rows].float().transpose(1, 2)
    logits = qs @ k.float().transpose(1, 2).transpose(-1, -2) / math.sqrt(D) + bias[:, :, None]
    if keep is not None:
        logits = logits.masked_fill(~keep[None], float("-inf"))
    return (logits.softmax(-1) @ v.float().transpose(1, 2)).transpose(1, 2)


def rel(out, ref, rows):
    o = out[:, rows].float()
    return ((o - ref).norm() / ref.norm()).item()


def timed(fns: dict, rounds: int = 5) -> dict:
    """name -> median ms over rounds, each round every path once (CUDA-graph replay where it captures)."""
    calls = {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            calls[name] = graph.replay
        except Exception as e:  # noqa: BLE001 - a path that cannot capture is timed eagerly
            torch.cuda.synchronize()
            print(f"  {name}: eager ({type(e).__name__}: {str(e)[:120]})")
            calls[name] = fn
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(cuda_ms(call, reps=5, warmup=1))
    return {name: statistics.median(t) for name, t in times.items()}
