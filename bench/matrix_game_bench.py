"""Matrix-Game 2.0 at its real shapes under FAST-AR's caches: ms per chunk and memory over a long rollout.

The universal model's shapes (Wan 2.1 1.3B with the action module in blocks 0-14, 36 input channels, 257
CLIP-vision tokens; random weights, bf16) at 352x640 (880 tokens a latent frame), chunks of 3 latent
frames at its 3 steps: Matrix-Game 2.0's own rolling window of 6 latent frames (sink 0, the open chunk
and 3 frames before it, ``window6``) against TempCache budgets (sink 0) that hold more of the past.
Settings take turns for ``--repeats`` rounds of ``--chunks`` chunks each (the median of each rollout's
last half, then the median over rounds); one long rollout per setting (``--long`` latent frames) reports
its ms per chunk, allocated device memory and resident host memory in its first and last tenth, and
their ratios (flat: about 1).
Actions: W held with a slow turn, the same for every setting. ``--profile``: one steady chunk of each
setting under torch.profiler (its CUDA graph replayed), its kernels' time summed by part (attention,
TempCache's merge, AnnSA's planning, the GEMMs, norms and RoPE, the rest) with the 25 longest kernels:
what a budget costs beyond attention over its extra keys.

    python bench/matrix_game_bench.py --out bench/results          # an H200 / H100
    python bench/matrix_game_bench.py --smoke --out /tmp           # tiny shapes on the CPU: the script only
    python bench/matrix_game_bench.py --settings window6,tempcache6 --long 0 --profile   # where the time goes
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, write_json  # noqa: E402,F401  (fastar: the checkout, imported)
from comfyui_fastar.fastar import CacheConfig, TempCacheConfig  # noqa: E402
from comfyui_fastar.fastar.models import MatrixGameModel, WanConfig  # noqa: E402
from comfyui_fastar.fastar.models.matrix_game import ActionConfig  # noqa: E402
from comfyui_fastar.fastar.schedule import FlowMatchSchedule  # noqa: E402

SETTINGS = {
    "window6": CacheConfig("window", sink_frames=0, window_frames=3),
    "tempcache3": TempCacheConfig(max_cache_frames=3, sink_frames=0),  # the window's keys, merged history
    "tempcache6": TempCacheConfig(max_cache_frames=6, sink_frames=0),
    "tempcache9": TempCacheConfig(max_cache_frames=9, sink_frames=0),
    "tempcache12": TempCacheConfig(max_cache_frames=12, sink_frames=0),
    "tempcache18": TempCacheConfig(max_cache_frames=18, sink_frames=0),
    # the memory tier beside the default budget (its host archive ~162 MB a latent frame here, in bf16, thinned
    # past fastar.recall.ARCHIVE_BYTES)
    "tempcache12recall6": TempCacheConfig(max_cache_frames=12, sink_frames=0, recall_frames=6),
}


def build(smoke: bool, device):
    if smoke:
        cfg = WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, in_dim=36, text_dim=48, freq_dim=32,
                        text_len=257)
        actions, hw = ActionConfig(4, 2, 1, hidden=128, keyboard_hidden=16), (32, 64)
    else:
        cfg = WanConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, in_dim=36, text_dim=1280,
                        text_len=257)
        actions, hw = ActionConfig(4, 2, 15), (352, 640)
    with torch.device("meta"):
        model = MatrixGameModel(cfg, actions)
    dtype = torch.float32 if smoke else torch.bfloat16
    return model.to_empty(device=device).to(dtype).init_random(0).eval().requires_grad_(False), hw


# kernel names by part (Triton's are the kernels/ functions'; cuDNN's, FA4's, cuBLAS's and torch's by theirs)
PARTS = (("attention", ("attention", "attend", "flash", "fmha", "sdpa", "cudnn", "combine_splits", "lse_update")),
         ("tempcache merge", ("pair_cosine", "row_argmax", "merge_rows", "scatter_rows", "gather_rows", "move_rows",
                              "unit_fp8")),
         ("annsa planning", ("block_means", "quant_scores", "quant_shares", "quantize_rows", "order_key", "sort")),
         ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "sm90_", "matmul")),
         ("norm and rope", ("adaln", "qk_norm_rope", "layer_norm", "rms")))


def part(name: str) -> str:
    low = name.lower()
    return next((p for p, keys in PARTS if any(k in low for k in keys)), "other")


def profile(prof, chunks: int = 1) -> dict:
    """A profiled chunk's kernels: total ms, ms by part, the 25 longest kernels."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_part, by_name = {}, {}
    for e in kernels:
        ms = (e.time_range.end - e.time_range.start) / 1e3 / chunks
        by_part[part(e.name)] = by_part.get(part(e.name), 0.0) + ms
        by_name[e.name] = by_name.get(e.name, 0.0) + ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {"kernel_ms": sum(by_part.values()), "by_part_ms": by_part,
            "top_kernels_ms": [[name[:120], ms] for name, ms in top], "kernels": len(kernels) / chunks}


def host_bytes() -> int:
    """This process's resident host memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rollout(model, hw, frames, cache, device, profile_chunk: int | None = None):
    """A rollout's per-chunk ms and (device, host) bytes (and, at ``profile_chunk``, that chunk's profile)."""
    g = torch.Generator(device=device).manual_seed(0)
    h, w = hw[0] // 8, hw[1] // 8
    condition = torch.randn(1, 20, 1, h, w, device=device, generator=g)
    clip = torch.randn(1, 257, model.context_dim, device=device, generator=g).to(model.dtype)
    rows = 1 + 4 * (frames - 1)
    keyboard = torch.zeros(1, rows, 4, device=device)
    keyboard[..., 0] = 1.0
    mouse = torch.zeros(1, rows, 2, device=device)
    mouse[..., 1] = 0.02
    run = model.rollout(clip, condition, keyboard, mouse, frames=frames, height=hw[0], width=hw[1], cache=cache,
                        schedule=FlowMatchSchedule((1000.0, 666.0, 333.0), 5.0))
    ms, mem, prof = [], [], {}
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def on_chunk(r):
        ms.append(r.latency_s * 1e3)
        mem.append((torch.cuda.memory_allocated(device) if device.type == "cuda" else 0, host_bytes()))
        if profile_chunk is not None and r.chunk == profile_chunk - 1:
            prof["p"] = torch.profiler.profile(activities=activities)
            prof["p"].start()
        elif "p" in prof and r.chunk == profile_chunk:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof["p"].stop()
            prof["summary"] = profile(prof.pop("p"))

    run.run(on_chunk, keep=False)
    return (ms, mem, prof["summary"]) if profile_chunk is not None else (ms, mem)


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=2001, help="latent frames of the long rollouts (default 2001; 0: none)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"which of {', '.join(SETTINGS)} (default all)")
    ap.add_argument("--name", default="matrix_game_bench", help="the result file's name, without .json")
    ap.add_argument("--profile", action="store_true", help="profile a steady chunk of each setting (by part)")
    args = ap.parse_args()
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.chunks, args.repeats, args.long = 4, 1, 12
    model, hw = build(args.smoke, device)
    frames = 3 * args.chunks
    result = {**header(device), "shape": {"height": hw[0], "width": hw[1], "layers": model.num_layers,
                                          "action_blocks": model.actions.blocks}, "settings": {}}
    times = {name: [] for name in settings}
    with torch.inference_mode():
        for name, cache in settings.items():
            rollout(model, hw, 6, cache, device)  # compiles, plans
        for _ in range(args.repeats):
            for name, cache in settings.items():
                ms, _ = rollout(model, hw, frames, cache, device)
                times[name].append(statistics.median(ms[len(ms) // 2:]))
        base = statistics.median(times["window6" if "window6" in times else next(iter(times))])  # vs_window6: the
        # first setting's where the window is not run
        print(f"{result['device']}, Matrix-Game 2.0 universal shapes at {hw[1]}x{hw[0]}, {args.repeats} rounds of "
              f"{args.chunks} chunks")
        for name in settings:
            m = statistics.median(times[name])
            result["settings"][name] = {"ms_per_chunk": m, "vs_window6": m / base, "rounds": times[name]}
            print(f"  {name:12s} {m:8.1f} ms a chunk  {m / base:.3f}x window6")
        if args.profile:  # a steady chunk: the cache full, its graph replayed
            for name, cache in settings.items():
                _, _, prof = rollout(model, hw, frames, cache, device, profile_chunk=args.chunks - 2)
                result["settings"][name]["profile"] = prof
                parts = ", ".join(f"{p} {v:.1f}" for p, v in sorted(prof["by_part_ms"].items(), key=lambda kv: -kv[1]))
                print(f"  {name:12s} kernels {prof['kernel_ms']:.1f} ms a chunk: {parts}")
        for name in [n for n in ("window6", "tempcache12", "tempcache12recall6") if n in settings and args.long]:
            tic = time.perf_counter()
            ms, mem = rollout(model, hw, args.long - args.long % 3, SETTINGS[name], device)
            tenth = max(len(ms) // 10, 1)
            first, last = ms[1:1 + tenth], ms[-tenth:]
            row = {"frames": 3 * len(ms), "first_ms": statistics.median(first), "last_ms": statistics.median(last),
                   "first_bytes": max(m for m, _ in mem[1:1 + tenth]), "last_bytes": max(m for m, _ in mem[-tenth:]),
                   "first_host_bytes": max(h for _, h in mem[1:1 + tenth]),
                   "last_host_bytes": max(h for _, h in mem[-tenth:]), "minutes": (time.perf_counter() - tic) / 60}
            row["latency_ratio"] = row["last_ms"] / row["first_ms"]
            row["memory_ratio"] = row["last_bytes"] / max(row["first_bytes"], 1)
            result["settings"][name]["long"] = row
            print(f"  {name:12s} {row['frames']} frames: {row['first_ms']:.1f} -> {row['last_ms']:.1f} ms a chunk "
                  f"({row['latency_ratio']:.3f}x), {row['first_bytes'] / 1e9:.2f} -> {row['last_bytes'] / 1e9:.2f} GB "
                  f"({row['memory_ratio']:.3f}x), host {row['first_host_bytes'] / 1e9:.1f} -> "
                  f"{row['last_host_bytes'] / 1e9:.1f} GB")
    print("wrote", write_json(args.out, args.name + ("_smoke" if args.smoke else "") + ".json", result))


if __name__ == "__main__":
    main()
