"""Where a steady-state chunk's time goes: GPU kernel time per kernel, grouped, for each setting.

Runs each setting's rollout past the TempCache budget, then profiles one chunk (torch.profiler,
CUDA activity): the chunk's wall time, the sum of its kernels' GPU time (their ratio says whether
the host or the GPU sets the pace) and the kernels grouped by what they do. Writes chunk_profile.json.

    python bench/chunk_profile.py --out bench/results      # about 1 minute on an H200
    python bench/chunk_profile.py --settings fastar        # only the named settings (e2e_bench's, window12, tempcache12)
    python bench/chunk_profile.py --prompt wan             # the clip's real prompt -> chunk_profile_wan.json
    python bench/chunk_profile.py --smoke --out /tmp       # tiny model on the CPU: checks the script only
"""
import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, rollouts, shapes, write_json  # noqa: E402
from common.testbed import CHUNK, testbed  # noqa: E402

# kernel-name fragments -> group, first match wins (cuDNN / Triton / cuBLAS / ATen kernel names)
GROUPS = [("sparse attention", ("_block_sparse", "block_sparse", "combine_splits")), ("quant scores", ("quant_scores",)),
          ("block means", ("block_means",)),
          ("dense attention", ("cudnn", "fmha", "flash", "attention")), ("qk norm + rope", ("qk_norm_rope",)),
          ("tempcache match", ("correspondence", "_match")), ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90")),
          ("sort", ("sort", "radix")), ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather_rows")),
          ("norm / modulate / gelu", ("norm", "gelu", "mul", "add", "elementwise", "vectorized")),
          ("reduce", ("reduce",))]


# the e2e settings, the 12-frame pair the defaults are chosen between, and AnnSA at 21 frames against
# TempCache 21 alone (where it pays on one prompt and not on the other)
SETTINGS = {**rollouts.SETTINGS, "window12": rollouts.SETTINGS["sink+window"],
            "tempcache12": (fastar.TempCacheConfig(max_cache_frames=12), None),
            "tempcache21": (fastar.TempCacheConfig(max_cache_frames=21), None),
            "fastar21": (fastar.TempCacheConfig(max_cache_frames=21), fastar.AnnConfig())}


def group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def profile_chunk(model, ctx, hw, name, chunks, device):
    """Profile the last of ``chunks`` chunks of a rollout of setting ``name``, run as ``Rollout.run`` runs
    it (AnnSA's review between chunks included)."""
    run = rollouts.make_run(model, ctx, chunks * CHUNK, hw, name, settings=SETTINGS)
    cuda = device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    wall = {}

    last = {}

    def on_chunk(r):
        wall[r.chunk] = 1e3 * r.latency_s
        last.update(annsa_sparse=r.annsa_sparse, annsa_density=r.annsa_density)
        if r.chunk == chunks - 2:  # the report syncs: the profile holds the last chunk alone
            prof.start()

    with torch.inference_mode():
        run.run(on_chunk)
    prof.stop()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name][0] += ev.time_range.elapsed_us() / 1e3
            kernels[ev.name][1] += 1
    groups = collections.defaultdict(float)
    for k, (ms, _) in kernels.items():
        groups[group(k)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:60]
    return {"wall_ms": wall[chunks - 1], "wall_previous_ms": wall[chunks - 2], "gpu_ms": sum(groups.values()), **last,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": k[:160], "ms": ms, "calls": n} for k, (ms, n) in top]}


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--settings", default="tempcache,fastar,sink+window",
                    help=f"comma-separated: {', '.join(SETTINGS)}")
    ap.add_argument("--prompt", choices=("random", "wan"), default="random",
                    help="the Gaussian stand-in or the clip's real prompt (AnnSA's density depends on it)")
    args = ap.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {', '.join(unknown)}; choose among {', '.join(SETTINGS)}")
    device, size, hw = shapes(args.smoke)
    model, ctx = testbed(size=size, device=str(device), prompt=args.prompt)
    chunks = 3 if args.smoke else 10  # the 21-frame TempCache budget fills after 7 chunks
    out = {**header(device), "chunk": chunks - 1, "prompt": args.prompt}
    rollouts.real_rollout(model, ctx, 2, hw, "fastar")  # warm-up: Triton compiles, cuDNN plans
    for name in names:
        r = profile_chunk(model, ctx, hw, name, chunks, device)
        out[name] = r
        print(f"{name}: wall {r['wall_ms']:.1f} ms (previous chunk {r['wall_previous_ms']:.1f}), "
              f"GPU kernels {r['gpu_ms']:.1f} ms, AnnSA sparse layers {r.get('annsa_sparse')}, "
              f"density {r.get('annsa_density')}", flush=True)
        for g, ms in r["groups_ms"].items():
            print(f"   {g:24s} {ms:8.1f} ms")
        for k in r["top_kernels"][:12]:
            print(f"     {k['ms']:8.2f} ms {k['calls']:5d}x  {k['name'][:100]}")
    name = "chunk_profile" + ("_wan" if args.prompt == "wan" else "") + ("_smoke" if args.smoke else "")
    write_json(args.out, name + ".json", out)


if __name__ == "__main__":
    main()
