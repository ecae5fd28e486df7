"""FAST-AR inside ComfyUI against the library, on the same weights, in one run.

The sensitized Wan 2.1 1.3B testbed (bench/common/testbed.py, random weights at real shapes, the real clip's
prompt) is written to a safetensors file twice, plain and with the metadata that makes core ComfyUI load
it as ``WAN21_CausalAR``. Then, one after another in this process, for FAST-AR at its defaults
(TempCache + ANN Sparsity) and for the dense sink 3 + window 12 cache, ``--chunks`` chunks each:

  library       ``load_wan`` + ``Rollout`` (the library's fused forward and CUDA graphs)
  comfy-default ComfyUI's UNETLoader ("default" weight dtype) -> FAST-AR Patch Model -> Autoregressive
                Long Sampler, called as ComfyUI's executor calls them (inside ``torch.inference_mode``)
  comfy-bf16    the same with ComfyUI's ``--bf16-unet``
  comfy-fp8     the same with UNETLoader's weight dtype fp8_e4m3fn (weights stored in fp8, computed in bf16)
  core-ar       core's AR graph: UNETLoader on the causal file -> FAST-AR Patch Model -> SamplerCustom with
                Empty AR Video Latent, BasicScheduler (simple, 4 steps) and FAST-AR AR Video
  comfy-fallback  comfy-bf16 with another pack's attention override set: ComfyUI's own forward
                (the fallback engine), FAST-AR defaults only, profiled early and late
  core-sampler  core's own SamplerARVideo in that graph (dense cache sized for the whole video), as far
                as ``--core-chunks``

Per run: per-chunk wall time (the pack's own ``fastar.cache`` events, or the library's chunk reports;
core's sampler: its block loop), peak memory allocated and held, and over two steady chunks the
GPU-busy time (union of kernel intervals) against wall time and the host's launches per chunk (kernels,
graph replays, copies), from torch.profiler. Those two chunks are left out of the latency statistics.
Beside: one chunk forward of the fused engine against ComfyUI's own forward on the same bf16 weights,
next to ComfyUI's bf16 forward against its fp32 one (the bf16 noise between the paths).

    python bench/comfy_bench.py --comfyui PATH --out bench/results   # PATH: a ComfyUI with core's AR path; H200 ~9 min
    python bench/comfy_bench.py --comfyui PATH --smoke      # tiny model on the CPU: checks the script only

On a GPU machine without the tree's dependencies, carry what ``bench/comfy_site.py`` packs and run with
``PYTHONPATH=.comfyui/gpu/site`` and ``--comfyui .comfyui/gpu/tree``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, write_json  # noqa: E402
from common.comfyui import SETTINGS, ChunkEvents, fastar_nodes, harness, load_unet  # noqa: E402
from common.testbed import prompt_context, testbed  # noqa: E402

PATHS = ("library", "comfy-default", "comfy-bf16", "comfy-fp8", "core-ar", "comfy-fallback")
EXTRAS = ("core-sampler", "agreement")  # core's own dense sampler; the fused forward against ComfyUI's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="a ComfyUI tree with core's autoregressive files (core-ar-2026)")
    p.add_argument("--chunks", type=int, default=60, help="chunks per run (3 latent frames each)")
    p.add_argument("--core-chunks", type=int, default=60, help="chunks of core's own dense SamplerARVideo")
    p.add_argument("--profile-at", type=int, default=30, help="first of the two profiled chunks")
    p.add_argument("--out", default=None, help="folder for comfy_bench.json / .png")
    p.add_argument("--prompt", choices=("wan", "random"), default="wan",
                   help="the clip's real prompt (default) or the Gaussian stand-in (bench/common/testbed.py)")
    p.add_argument("--paths", default=",".join(PATHS + EXTRAS),
                   help=f"comma-separated, of {', '.join(PATHS + EXTRAS)} (default: all)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the paths and settings; a run's ms/chunk is the median of its rounds' medians")
    p.add_argument("--tag", default="comfy_bench", help="the result files' name (default comfy_bench)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script only)")
    p.add_argument("--replot", metavar="JSON", help="only print the table and plot of an earlier run's JSON")
    return p.parse_args(argv)


# -- measurement -----------------------------------------------------------------------------------
class Chunks:
    """Per-chunk wall times, with a torch.profiler window over two steady chunks."""

    def __init__(self, device, profile_at: int, also_at: int | None = None):
        self.device, self.profile_at, self.also_at = device, profile_at, also_at
        self.times, self.prof, self.window, self.early = [], None, None, None

    def __call__(self, chunk: int, seconds: float) -> None:
        """After chunk ``chunk`` (0-based) finished, ``seconds`` after it started."""
        self.times.append(seconds)
        starts = {self.profile_at, self.also_at}
        if chunk + 1 in starts and self.device.type == "cuda":
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()
        elif chunk - 1 in starts and self.prof is not None:
            torch.cuda.synchronize(self.device)
            self.prof.stop()
            window = self._busy(self.prof, sum(self.times[-2:]))
            if chunk - 1 == self.also_at:
                self.early = window
            else:
                self.window = window
            self.prof = None

    def skipped(self) -> set:
        return {c for s in (self.profile_at, self.also_at) if s is not None for c in (s, s + 1)}

    @staticmethod
    def _busy(prof, wall_s: float) -> dict:
        kernels, launches = [], 0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append((e.time_range.start, e.time_range.end))
            elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"):
                launches += 1
        busy, end = 0.0, float("-inf")
        for s, e in sorted(kernels):
            if e > end:
                busy += e - max(s, end)
                end = e
        host = sorted(((e.key, e.cpu_time_total / 2e3) for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CPU), key=lambda kv: -kv[1])[:12]
        return {"gpu_busy_ms_per_chunk": busy / 2e3, "wall_ms_per_chunk": wall_s * 1e3 / 2,
                "host_launches_per_chunk": launches / 2, "kernels_per_chunk": len(kernels) / 2,
                "host_ms_per_chunk_top_ops": host}

    def summary(self, full_after: int) -> dict:
        skip = self.skipped()
        keep = [t for i, t in enumerate(self.times) if i not in skip]
        steady = [t for i, t in enumerate(self.times[full_after:], full_after) if i not in skip]
        n = min(20, len(steady) // 2) or 1
        return {"ms_per_chunk": [1e3 * t for t in self.times],
                "median_ms": 1e3 * statistics.median(steady or keep),
                "drift_last_vs_first": statistics.median(steady[-n:]) / statistics.median(steady[:n]) if steady else None,
                "profile": self.window, "profile_early": self.early}


@contextlib.contextmanager
def memory(device, out: dict):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        out["peak_held_gb"] = torch.cuda.max_memory_reserved(device) / 1e9


def full_after(setting: str) -> int:
    """The first chunk whose cache is full (TempCache's budget, or 3 + 12 frames)."""
    frames = fastar.TempCacheConfig().max_cache_frames if setting == "fastar" else 15
    return -(-frames // 3)


# -- the paths -------------------------------------------------------------------------------------
def run_library(path, context, setting, chunks, device, dims, profile_at):
    model = fastar.models.load_wan(path, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    cache = fastar.TempCacheConfig() if setting == "fastar" else fastar.CacheConfig("window", 3, 12)
    ann = None  # FAST-AR's defaults run TempCache alone
    rec, out = Chunks(device, profile_at), {"engine": "library"}
    with torch.inference_mode(), memory(device, out):
        run = fastar.Rollout(model, context.to(device, model.dtype), frames=3 * chunks, height=dims[0],
                             width=dims[1], chunk_frames=3, cache=cache, ann=ann)
        finite = bool(run.run(lambda r: rec(r.chunk, r.latency_s)).isfinite().all())
        del run
    del model
    return {**out, "finite": finite, **rec.summary(full_after(setting))}


def other_packs_override(func, *args, **kwargs):
    """An attention override another pack might set (as SageAttention patches do), calling through:
    the fused engine cannot honour it, so the rollout runs on ComfyUI's forward."""
    return func(*args, **kwargs)


def run_comfy(comfy, name, positive, setting, chunks, device, dims, profile_at, dtype_flag, graph,
              fallback=False):
    import comfy.model_management
    from comfyui_fastar.nodes.sampler_nodes import ARVideo, AutoregressiveLongSampler
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    rec, out = Chunks(device, profile_at, also_at=full_after(setting) + 2 if fallback else None), {}
    try:
        with ChunkEvents(rec) as events, torch.inference_mode():
            model = load_unet(comfy, name, dtype_flag)
            out["weights"] = str(model.model.get_dtype()).replace("torch.", "")
            out["compute"] = str(model.model.manual_cast_dtype or model.model.get_dtype()).replace("torch.", "")
            out["model_class"] = type(model.model).__name__ + " / " + type(model.model.diffusion_model).__name__
            cache, ann = fastar_nodes(setting)
            if fallback:
                model = model.clone()
                model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
                    other_packs_override
            patched = PatchModel.execute(model, cache, ann).result[0]
            comfy.model_management.load_models_gpu([patched])  # weights in place before the peak is reset
            length = (3 * chunks - 1) * 4 + 1
            with memory(device, out):
                if graph == "long":
                    latent = AutoregressiveLongSampler.execute(patched, positive, dims[1], dims[0], length, 1, 0,
                                                               "1000,750,500,250", 5.0, "3", 0.0, 1.0).result[0]
                else:
                    sampler = ARVideo.execute(3).result[0]
                    latent = core_graph(patched, positive, sampler, dims, length)
            out["finite"] = bool(latent["samples"].isfinite().all())  # a NaN video's times measure nothing
            out["engine"] = events.engine
            del model, patched
    finally:
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
    return {**out, **rec.summary(full_after(setting))}


def core_graph(model, positive, sampler, dims, length):
    from comfy_extras.nodes.nodes_ar_video import EmptyARVideoLatent
    from comfy_extras.nodes.nodes_custom_sampler import BasicScheduler, SamplerCustom

    latent = EmptyARVideoLatent.execute(dims[1], dims[0], length, 1).result[0]
    sigmas = BasicScheduler.execute(model, "simple", 4, 1.0).result[0]
    return SamplerCustom.execute(model, True, 0, 1.0, positive, positive, sampler, sigmas, latent).result[0]


def run_core_sampler(comfy, name, positive, chunks, device, dims):
    """Core's own SamplerARVideo, timed by its block loop (``trange`` in k_diffusion.sampling)."""
    import comfy.k_diffusion.sampling as sampling
    import comfy.model_management
    from comfy_extras.nodes.nodes_ar_video import SamplerARVideo

    rec, out = Chunks(device, -10), {"engine": "core"}
    original = sampling.trange

    def timed(n, **kw):
        for i in original(n, **kw):
            tic = time.perf_counter()
            yield i
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rec(i, time.perf_counter() - tic)

    sampling.trange = timed
    try:
        with torch.inference_mode():
            model = load_unet(comfy, name, None)
            out["weights"] = str(model.model.get_dtype()).replace("torch.", "")
            comfy.model_management.load_models_gpu([model])
            with memory(device, out):
                core_graph(model, positive, SamplerARVideo.execute(3).result[0], dims, (3 * chunks - 1) * 4 + 1)
            del model
    except torch.OutOfMemoryError as exc:
        out["error"] = f"out of memory after {len(rec.times)} chunks: {str(exc).splitlines()[0]}"
    finally:
        sampling.trange = original
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
    summary = rec.summary(0)
    return {**out, **summary, "chunks": len(rec.times)}


def forward_agreement(comfy, name, context, device, dims):
    """One chunk forward: fused vs ComfyUI on the same bf16 weights, and ComfyUI bf16 vs fp32."""
    import comfy.model_management
    from comfyui_fastar.nodes.fused import fused_wan

    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(1, 16, 3, dims[0] // 8, dims[1] // 8, generator=g).to(device)
    t = torch.tensor([625.0], device=device)
    outs = {}
    with torch.inference_mode():
        for label, flag in (("bf16", "bf16"), ("fp32", "fp32")):
            import comfy.cli_args

            comfy.cli_args.args.fp32_unet = flag == "fp32"
            try:
                model = load_unet(comfy, name, flag)
            finally:
                comfy.cli_args.args.fp32_unet = False
            comfy.model_management.load_models_gpu([model])
            dm = model.model.diffusion_model
            dtype = model.model.get_dtype()
            outs[label] = dm(x.to(dtype), t, context.to(device, dtype)).float()
            if label == "bf16":
                fused = fused_wan(dm)
                outs["fused"] = fused(x.to(dtype), t, context.to(device, dtype)).float()
                del fused
            del model, dm
            comfy.model_management.unload_all_models()
            comfy.model_management.soft_empty_cache()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    return {"fused_vs_comfy_bf16": rel(outs["fused"], outs["bf16"]),
            "comfy_bf16_vs_fp32": rel(outs["bf16"], outs["fp32"]),
            "fused_bf16_vs_comfy_fp32": rel(outs["fused"], outs["fp32"])}


# -- main ------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            return report(json.load(f), args.out, args.tag)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    comfy = harness.import_comfy(args.comfyui, cpu=device.type == "cpu")
    import comfy.cmd.folder_paths as folder_paths

    if args.smoke:
        args.chunks, args.core_chunks, args.profile_at = min(args.chunks, 9), min(args.core_chunks, 3), 4
        model = harness.tiny_wan()
        dims = (32, 32)
        context = prompt_context(model.context_dim)
    else:
        model, context = testbed(prompt=args.prompt)
        dims = (480, 832)
    folder = tempfile.mkdtemp(prefix="fastar_comfy_bench_")
    plain, _ = harness.write_wan(model, folder, "testbed", torch.bfloat16)  # and testbed_causal.safetensors
    del model
    folder_paths.add_model_folder_path("diffusion_models", folder)
    context = context.float().cpu()
    positive = [[context, {}]]

    results = {**header(device, None if argv is None else [__file__, *argv]),
               "shapes": {"height": dims[0], "width": dims[1], "chunk_frames": 3, "chunks": args.chunks,
                          "steps": 4},
               "weights": "bench/common/testbed.py sensitized random weights, "
                          + ("the Wan clip's prompt" if args.prompt == "wan" else "a Gaussian stand-in prompt"),
               "prompt": args.prompt, "repeats": args.repeats, "runs": {}}
    paths = args.paths.split(",")
    if any(p not in PATHS + EXTRAS for p in paths):
        raise SystemExit(f"--paths: choose among {', '.join(PATHS + EXTRAS)}")
    rounds = {}
    combos = [(setting, path) for setting in SETTINGS for path in PATHS
              if path in paths and (path != "comfy-fallback" or setting == "fastar")]  # the fallback: defaults only
    for _ in range(args.repeats):
        for setting, path in combos:
            print(f"-- {path} / {setting}", flush=True)
            if path == "library":
                r = run_library(str(plain), context, setting, args.chunks, device, dims, args.profile_at)
            elif path == "comfy-fallback":
                r = run_comfy(comfy, "testbed.safetensors", positive, setting, args.chunks, device, dims,
                              args.profile_at, "bf16", "long", fallback=True)
            elif path == "core-ar":
                r = run_comfy(comfy, "testbed_causal.safetensors", positive, setting, args.chunks, device,
                              dims, args.profile_at, None, "core")
            else:
                flag = {"comfy-bf16": "bf16", "comfy-fp8": "fp8"}.get(path)
                r = run_comfy(comfy, "testbed.safetensors", positive, setting, args.chunks, device, dims,
                              args.profile_at, flag, "long")
            print(f"   {r['median_ms']:.1f} ms/chunk, drift {r['drift_last_vs_first']:.3f}, engine {r.get('engine')}"
                  + ("" if r["finite"] else ", OUTPUT NOT FINITE"), flush=True)
            rounds.setdefault(f"{path}/{setting}", []).append(r["median_ms"])
            r["round_medians_ms"] = rounds[f"{path}/{setting}"]
            r["median_ms"] = statistics.median(r["round_medians_ms"])
            results["runs"][f"{path}/{setting}"] = r  # the last round's chunks, every round's median
    if "core-sampler" in paths:
        print("-- core-sampler / dense unbounded", flush=True)
        results["runs"]["core-sampler/dense"] = run_core_sampler(comfy, "testbed_causal.safetensors", positive,
                                                                 args.core_chunks, device, dims)
    if "agreement" in paths:
        results["forward_agreement"] = forward_agreement(comfy, "testbed.safetensors", context, device, dims)
    report(results, args.out, args.tag)
    return results


def report(results, out, tag="comfy_bench"):
    runs = results["runs"]
    print(f"\n{results['device']}, {results['shapes']}")
    print(f"{'run':28s} {'engine':8s} {'weights':9s} {'ms/chunk':>9s} {'x lib':>6s} {'drift':>6s} {'alloc GB':>9s} "
          f"{'held GB':>8s} {'busy/wall':>10s} {'launches':>9s}")
    for name, r in runs.items():
        lib = runs.get(f"library/{name.split('/')[1]}")
        ratio = r["median_ms"] / lib["median_ms"] if lib else float("nan")
        p = r.get("profile") or {}
        busy = f"{p['gpu_busy_ms_per_chunk']:.0f}/{p['wall_ms_per_chunk']:.0f}" if p else "-"
        print(f"{name:28s} {str(r.get('engine')):8s} {r.get('weights', 'bf16'):9s} {r['median_ms']:9.1f} {ratio:6.3f} "
              f"{(r['drift_last_vs_first'] or float('nan')):6.3f} {r.get('peak_allocated_gb', float('nan')):9.2f} "
              f"{r.get('peak_held_gb', float('nan')):8.2f} {busy:>10s} {p.get('host_launches_per_chunk', float('nan')):9.0f}")
    for name, r in runs.items():
        window = runs.get(name.replace("/fastar", "/window"))
        if name.endswith("/fastar") and window:
            print(f"{name.split('/')[0]}: the defaults at {r['median_ms'] / window['median_ms']:.3f}x sink 3 + window 12")
    broken = [name for name, r in runs.items() if not r.get("finite", True)]
    if broken:
        print("NOT FINITE (their times measure a broken video):", ", ".join(broken))
    if "forward_agreement" in results:
        print("forward agreement:", {k: f"{v:.2e}" for k, v in results["forward_agreement"].items()})
    if out:
        write_json(out, f"{tag}.json", results)
        plot(results, os.path.join(out, f"{tag}.png"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
    for ax, setting in zip(axes, ("fastar", "window")):
        tops = [1.0]
        for name, r in results["runs"].items():
            if name.endswith("/" + setting) or (setting == "window" and name == "core-sampler/dense"):
                ax.plot(range(1, len(r["ms_per_chunk"]) + 1), r["ms_per_chunk"], label=f"{name} ({r.get('engine')})",
                        lw=1.2)
                tops.append(max(r["ms_per_chunk"][-20:]))
        ax.set_ylim(0, 1.3 * max(tops))  # the first chunks compile kernels: off scale
        ax.set_xlabel("chunk (3 latent frames)")
        ax.set_ylabel("ms per chunk")
        ax.set_title({"fastar": "FAST-AR defaults (TempCache alone)",
                      "window": "dense sink 3 + window 12 (and core's dense SamplerARVideo)"}[setting], fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"ComfyUI paths vs the library, {results['device']}, Wan 2.1 1.3B shapes "
                 f"{results['shapes']['width']}x{results['shapes']['height']}, random weights", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
