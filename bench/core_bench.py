"""Dense baselines at Wan 2.1 1.3B shapes: per-chunk latency and peak memory against cached frames.

Measured in one run on one GPU (480x832, 3-frame chunks, 4 steps + clean pass, bf16, random weights):
  * dense unbounded, real rollout as far as --rollout-frames, and single chunks on caches prefilled to
    --points frames (the cache filled through its own protocol with random K/V), as far as memory allows;
  * dense sink+window (3 + 12), real rollout;
  * the floor: the same forwards with attention removed (self and cross return q);
  * raw SDPA at the same shapes (each layer's self- and cross-attention call, x 30 layers x 5 forwards).
The check: engine dense time <= 1.10 x (floor + raw SDPA) at every point.

    python bench/core_bench.py --out bench/results
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_ms, fastar, header, parser, wall_ms, write_json  # noqa: E402
from common.testbed import NoAttention, prefill  # noqa: E402

EVERY_FRAME = fastar.CacheConfig("unbounded")  # the dense cache these points measure

CacheConfig, Rollout = fastar.CacheConfig, fastar.Rollout
build_model = fastar.models.build_model

HEIGHT, WIDTH, CHUNK, TPF = 480, 832, 3, 1560


def sdpa_seconds(q_len, k_len, heads, dim, backend=None, reps=20):
    q = torch.randn(1, q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, k_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    backends = [backend] if backend else fastar.sdpa.SDPA_PRIORITY

    def call():
        with sdpa_kernel(backends, set_priority=backend is None):
            F.scaled_dot_product_attention(qt, kt, vt)
    try:
        return cuda_ms(call, reps) / 1e3
    except RuntimeError:
        return None


def main():
    ap = parser(__doc__)
    ap.add_argument("--points", default="21,81,162,240,321,402,450")
    ap.add_argument("--rollout-frames", type=int, default=81)
    ap.add_argument("--window-frames-total", type=int, default=240)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model("1.3B", device="cuda", dtype=torch.bfloat16)
    cfg = model.config
    context = torch.randn(1, 512, cfg.text_dim, device="cuda", dtype=torch.bfloat16)
    forwards = 5  # 4 denoising steps + clean pass
    calls = forwards * cfg.num_layers
    q_len = CHUNK * TPF
    result = {**header("cuda"),
              "shapes": {"height": HEIGHT, "width": WIDTH, "chunk_frames": CHUNK, "tokens_per_frame": TPF,
                         "layers": cfg.num_layers, "heads": cfg.num_heads, "head_dim": cfg.head_dim,
                         "text_tokens": 512, "forwards_per_chunk": forwards, "dtype": "bfloat16"}}

    # SDPA backends at one representative shape (81 cached frames + own chunk).
    k81 = (81 + CHUNK) * TPF
    flops = 4 * q_len * k81 * cfg.dim
    backends = {}
    for name, b in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("dispatch", None)]:
        t = sdpa_seconds(q_len, k81, cfg.num_heads, cfg.head_dim, b)
        backends[name] = None if t is None else {"ms": 1e3 * t, "tflops": flops / t / 1e12}
    result["sdpa_backends_81_frames"] = backends
    print("SDPA backends @81 frames:", {k: (round(v["ms"], 3) if v else None) for k, v in backends.items()})

    # Floor: forwards with attention removed (independent of cache size).
    run = Rollout(model, context, frames=CHUNK, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK, cache=EVERY_FRAME)
    run.attention = NoAttention()
    with torch.inference_mode():
        run.sample_chunk(0)
        floor = statistics.median(wall_ms(lambda: run.sample_chunk(0), 5)) / 1e3
    del run
    cross = sdpa_seconds(q_len, 512, cfg.num_heads, cfg.head_dim)
    result["floor_ms"] = 1e3 * floor
    result["cross_sdpa_ms_per_call"] = 1e3 * cross
    print(f"floor (attention removed): {1e3 * floor:.1f} ms/chunk; cross SDPA {1e3 * cross:.3f} ms/call")

    def raw_sdpa_chunk(cached_frames):
        self_t = sdpa_seconds(q_len, (cached_frames + CHUNK) * TPF, cfg.num_heads, cfg.head_dim)
        return calls * (self_t + cross), self_t

    # Dense unbounded, single chunks on prefilled caches.
    points = []
    for n in [int(p) for p in args.points.split(",")]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            run = Rollout(model, context, frames=n + CHUNK, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK,
                          cache=EVERY_FRAME)
            with torch.inference_mode():
                prefill(run, n)
                run.cache.begin_chunk(n, CHUNK)
                c = n // CHUNK
                run.sample_chunk(c)  # warm-up
                reps = wall_ms(lambda: run.sample_chunk(c), args.reps)
                t = statistics.median(reps) / 1e3
            peak = torch.cuda.max_memory_allocated() / 1e9
            held = run.cache.stats()
            del run
        except (torch.OutOfMemoryError, fastar.FastARError) as exc:
            print(f"dense unbounded @ {n} frames: out of memory ({str(exc)[:80]})")
            points.append({"cached_frames": n, "oom": True})
            run = None
            torch.cuda.empty_cache()
            continue
        raw, self_t = raw_sdpa_chunk(n)
        row = {"cached_frames": n, "latency_ms": 1e3 * t, "reps_ms": reps, "peak_gb": peak,
               "cache_held_gb": held.held_gb, "raw_sdpa_ms": 1e3 * raw, "self_sdpa_ms_per_call": 1e3 * self_t,
               "floor_plus_sdpa_ms": 1e3 * (floor + raw), "ratio_to_floor_plus_sdpa": t / (floor + raw),
               "source": "prefilled cache"}
        points.append(row)
        print(f"dense unbounded @ {n:4d} frames: {1e3 * t:8.1f} ms  floor+sdpa {1e3 * (floor + raw):8.1f} ms  "
              f"ratio {row['ratio_to_floor_plus_sdpa']:.3f}  peak {peak:6.1f} GB  self-SDPA {1e3 * self_t:.2f} ms")
    result["dense_unbounded_prefilled"] = points

    # Real rollouts: dense unbounded (short) and sink + window (long).
    def real(frames, cache):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rows = []
        run = Rollout(model, context, frames=frames, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK, cache=cache)

        def on_chunk(r):
            rows.append({"frames": r.frames_done, "cached_frames_before": r.frames_done - CHUNK,
                         "latency_ms": 1e3 * r.latency_s, "cache_held_gb": r.cache.held_gb,
                         "allocated_gb": r.cache.gb, "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
        with torch.inference_mode():
            run.run(on_chunk)
        return rows

    result["dense_unbounded_rollout"] = real(args.rollout_frames, CacheConfig("unbounded"))
    result["window_rollout"] = real(args.window_frames_total, CacheConfig("window", 3, 12))
    win = result["window_rollout"]
    steady = [r["latency_ms"] for r in win[5:]]
    raw_w, _ = raw_sdpa_chunk(15)
    result["window_summary"] = {
        "median_latency_ms": statistics.median(steady), "floor_plus_sdpa_ms": 1e3 * (floor + raw_w),
        "ratio_to_floor_plus_sdpa": statistics.median(steady) / 1e3 / (floor + raw_w),
        "last_over_first_steady": steady[-1] / steady[0],
        "peak_gb_first": win[5]["peak_gb"], "peak_gb_last": win[-1]["peak_gb"]}
    print("window:", {k: round(v, 3) for k, v in result["window_summary"].items()})
    for r in result["dense_unbounded_rollout"][::6]:
        print(f"dense rollout: frames {r['frames']:4d}  {r['latency_ms']:8.1f} ms  peak {r['peak_gb']:.1f} GB")

    ok = [p for p in points if not p.get("oom")]
    result["max_ratio_to_floor_plus_sdpa"] = max(p["ratio_to_floor_plus_sdpa"] for p in ok)
    path = write_json(args.out, "core_bench.json", result)
    plot(result, os.path.join(args.out, "core_bench.png"))
    print(f"max engine/(floor+SDPA) ratio: {result['max_ratio_to_floor_plus_sdpa']:.3f}; wrote {path}")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    pts = [p for p in result["dense_unbounded_prefilled"] if not p.get("oom")]
    x = [p["cached_frames"] for p in pts]
    ax_t.plot(x, [p["latency_ms"] for p in pts], "o-", label="dense unbounded (prefilled cache)")
    ax_t.plot(x, [p["floor_plus_sdpa_ms"] for p in pts], "k:", label="floor + raw SDPA")
    roll = result["dense_unbounded_rollout"]
    ax_t.plot([r["cached_frames_before"] for r in roll], [r["latency_ms"] for r in roll], ".",
              label="dense unbounded (real rollout)")
    win = result["window_rollout"]
    ax_t.plot([r["cached_frames_before"] for r in win], [r["latency_ms"] for r in win], ".-",
              label="dense sink 3 + window 12 (real rollout)")
    ax_t.axhline(result["floor_ms"], color="gray", ls="--", label="floor (attention removed)")
    ax_t.set(xlabel="latent frames cached before the chunk", ylabel="ms per chunk (4 steps + clean pass)",
             title="per-chunk latency")
    ax_m.plot(x, [p["peak_gb"] for p in pts], "o-", label="dense unbounded: peak allocated")
    ax_m.plot([r["cached_frames_before"] for r in win], [r["peak_gb"] for r in win], ".-",
              label="sink + window: peak allocated")
    ooms = [p["cached_frames"] for p in result["dense_unbounded_prefilled"] if p.get("oom")]
    for n in ooms:
        ax_m.axvline(n, color="red", ls=":", label=f"dense OOM at {n} frames")
    ax_m.set(xlabel="latent frames cached before the chunk", ylabel="GB", title="peak GPU memory")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Wan 2.1 1.3B shapes (480x832, chunk 3, bf16, random weights) on {result['device']}, "
                 f"{result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
