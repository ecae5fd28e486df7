"""Timing shared by the benchmarks: CUDA events around a call, or host wall time around a whole call."""
import statistics
import time

import torch


def cuda_ms(fn, reps: int = 15, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` on the current stream, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, reps: int, device=None) -> list[float]:
    """Host wall-clock milliseconds of each of ``reps`` calls of ``fn()``, with a CUDA device
    synchronised before and after each (host launch time included; no sync on a CPU)."""
    cuda = torch.device(device or "cuda").type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - tic))
    return times


def op_ms(fn, device) -> float:
    """Median milliseconds of one op: CUDA events on a GPU (``cuda_ms``), host wall time over three
    calls on a CPU (the benchmarks' --smoke runs)."""
    device = torch.device(device)
    return cuda_ms(fn) if device.type == "cuda" else statistics.median(wall_ms(fn, 3, device))


def graph_ms(fn, device) -> float:
    """Median milliseconds of ``fn`` captured once as a CUDA graph and replayed: its GPU time
    without the host's launch gaps, which is what a call costs inside a rollout whose host runs
    ahead of the GPU. On a CPU, ``op_ms`` (the benchmarks' --smoke runs)."""
    if torch.device(device).type != "cuda":
        return op_ms(fn, device)
    fn()  # warm-up outside the capture: compiles, cuDNN / cuBLAS plans
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay)
