"""What the benchmark scripts share: the package they measure, their arguments, timing, result files and the
random-weight model; the package's modules hold the rest (``testbed``, ``realvideo``, ``rollouts``, ``annsa``,
``comfyui``). Every script in ``bench/`` imports from this package only, never from another script.

``from common import fastar`` imports the checkout this folder belongs to as ``comfyui_fastar`` (pip-installed
or not: the GPU machines run it from the tree) and gives its ``fastar`` package, the models included.
``load_package`` imports any exported tree under a name of its own (``bench/ab.py`` holds two revisions side
by side that way); nothing here imports the package until a script asks for ``fastar``.

Every result file starts with ``header``: the device, the date, torch's version, and where the numbers come
from (``provenance``: the commit, whether the tree differed from it, the command); ``write_json`` writes
nothing without them.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")


def load_package(name: str, root: str):
    """The repository tree at ``root`` imported as the package ``name``; returns its ``fastar`` package
    (with ``fastar.models`` imported). The tree's own imports are relative, so two trees load side by side."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    importlib.import_module(f"{name}.fastar.models")
    return importlib.import_module(f"{name}.fastar")


def __getattr__(name):
    if name != "fastar":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "comfyui_fastar" in sys.modules:  # a caller (a test, ComfyUI) imported the pack already
        importlib.import_module("comfyui_fastar.fastar.models")
        package = importlib.import_module("comfyui_fastar.fastar")
    else:
        package = load_package("comfyui_fastar", ROOT)
    globals()["fastar"] = package
    return package


def window_cache(variant, chunk_frames: int = 3):
    """A Matrix-Game 2.0 variant's own self-attention cache: a rolling window of its ``local_frames`` latent
    frames, the open chunk among them (no sink); every frame for the foundation model."""
    config = __getattr__("fastar").config
    if variant.local_frames is None:
        return config.CacheConfig("unbounded")
    return config.CacheConfig("window", sink_frames=0, window_frames=variant.local_frames - chunk_frames)


# -- arguments -------------------------------------------------------------------------------------
def parser(doc: str, smoke: bool = False) -> argparse.ArgumentParser:
    """An argument parser whose help is the script's docstring, with ``--out`` (the folder the result
    files go to) and, where the script has one, ``--smoke`` (the tiny model on the CPU)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=RESULTS, help="folder for the result files (default bench/results)")
    if smoke:
        p.add_argument("--smoke", action="store_true", help="tiny model on the CPU at 64x96: checks the script only")
    return p


def shapes(smoke: bool) -> tuple[torch.device, str, tuple[int, int]]:
    """Device, model size and (height, width): the tiny model on the CPU for a smoke run, else Wan 2.1
    1.3B at 480x832 on the GPU."""
    return (torch.device("cpu"), "tiny", (64, 96)) if smoke else (torch.device("cuda"), "1.3B", (480, 832))


# -- result files ----------------------------------------------------------------------------------
def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result comes from: ``commit`` (this checkout's HEAD, "unknown" off git), ``dirty`` (whether
    the tracked files differed from it; None off git) and ``command`` (``python`` and ``argv``: the script's
    path and its arguments, default ``sys.argv``; paths inside the repository relative to its root)."""
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", None
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(argv[0])
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return {"commit": commit, "dirty": dirty, "command": shlex.join(["python", script, *argv[1:]])}


#: What ``header`` gives and ``write_json`` insists on.
HEADER = ("device", "date", "torch", "commit", "dirty", "command")


def header(device, argv: list[str] | None = None) -> dict:
    """What every result file starts with: the device, the date, torch's version and ``provenance(argv)``."""
    return {"device": device_name(device), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            **provenance(argv)}


def write_json(out: str, name: str, result: dict) -> str:
    """``result`` as ``out/name``; returns the path. ``result`` must hold ``header``'s keys."""
    missing = [k for k in HEADER if k not in result]
    if missing:
        raise ValueError(f"{name}: the result lacks {', '.join(missing)} (start it with common.header)")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return path


# -- timing ----------------------------------------------------------------------------------------
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


# -- the model -------------------------------------------------------------------------------------
# Chosen on the H200 (bench/NOTES.md, "Testbed"): with these, the own-chunk-only control falls 18 dB
# below the bf16 noise floor, and at layer 15 the top 1% of keys hold 0.70 of the attention mass.
SENSITIVE = {"qk_gain": 1.5, "k_noise": 0.5, "self_gain": 5.0}


@torch.no_grad()
def sensitize(model, qk_gain: float = 1.5, k_noise: float = 0.5, self_gain: float = 5.0, seed: int = 0):
    """Make a random Wan model attend as a trained one does (bench/common/testbed.py says why): tie each
    self-attention's key projection to its query projection (plus ``k_noise`` of fresh noise), set the
    q/k RMS norm gains to ``qk_gain`` (logits scale by its square: sharply peaked softmaxes) and scale
    the output projection by ``self_gain`` (the gated branch is otherwise a few % of the residual
    stream, so the cached history could not move the output). 3-axis RoPE then makes the match local
    in space and time. Touches the self-attention weights only, by their Wan state-dict names."""
    for i, block in enumerate(model.blocks):
        attn = block.self_attn
        attn.o.weight.mul_(self_gain)
        g = torch.Generator(device=attn.q.weight.device).manual_seed(seed * 1009 + i)
        noise = torch.randn(attn.q.weight.shape, device=attn.q.weight.device, generator=g)
        attn.k.weight.copy_(attn.q.weight + k_noise * attn.q.weight.float().std() * noise.to(attn.q.weight.dtype))
        attn.k.bias.copy_(attn.q.bias)
        attn.norm_q.weight.fill_(qk_gain)
        attn.norm_k.weight.fill_(qk_gain)
    return model


def testbed_model(package, size: str, device, dtype=torch.bfloat16):
    """The sensitized random-weight model of ``package`` (a ``fastar`` package: this checkout's, or a
    revision ``load_package`` imported) at ``size``, built in fp32 first so that every dtype holds the
    same weights."""
    torch.backends.cuda.matmul.allow_tf32 = True
    model = package.models.build_model(size, device=device, dtype=torch.float32)
    return sensitize(model, **SENSITIVE).to(dtype)


def random_prompt(text_dim: int, device, dtype, tokens: int = 512) -> torch.Tensor:
    """A seeded Gaussian stand-in for a prompt's text features, [1, tokens, text_dim]."""
    return torch.randn(1, tokens, text_dim, device=device, dtype=dtype,
                       generator=torch.Generator(device=device).manual_seed(0))
