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


def graphed(fn, device):
    """``fn`` captured once as a CUDA graph: returns its replay (on a CPU, ``fn`` itself)."""
    if torch.device(device).type != "cuda":
        return fn
    fn()  # warm-up outside the capture: compiles, cuDNN / cuBLAS plans
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def side_by_side_ms(fns: dict, device, rounds: int = 5) -> dict:
    """GPU milliseconds of each of ``fns`` (name -> call), each replayed from a CUDA graph: its GPU
    time without the host's launch gaps, which is what a call costs inside a rollout whose host
    runs ahead of the GPU. The calls take turns for ``rounds`` rounds (``op_ms`` each), so a drift
    of the clock between them cancels in their ratios; returns name -> list of per-round ms."""
    replays = {name: graphed(fn, device) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(op_ms(replay, device))
    return times
