"""End-to-end long rollouts: FAST-AR against dense attention, speed, memory and fidelity, in one run.

Wan 2.1 1.3B shapes (480x832, 3-frame chunks, 4 steps + clean pass, bf16), the sensitized random-weight
testbed of bench/common/testbed.py. Every number comes from this run on this device:

  speed     per-chunk latency and peak memory (tensors allocated, and memory held: the allocator's
            reserve, which alone counts a CUDA graph's working memory) against generated frames for
            dense unbounded, dense sink + window, TempCache only, AnnSA only, AnnCA only and
            FAST-AR at the pack's defaults (TempCache alone: the TempCache-only row is then that one).
            FAST-AR runs --chunks chunks for real (240 = 720 latent = 2880 video frames); the components
            run --component-chunks; dense unbounded runs --dense-chunks for real, then single chunks on caches
            prefilled to --dense-points frames, and the last point (which no card holds) is composed:
            the measured chunk at the largest prefilled point + 150 x the measured change in one layer's
            self-attention time. The end-to-end speedup is the ratio of the areas under the per-chunk
            latency curves over the whole rollout (dense interpolated between its points).
  floor     the linear layers alone (every nn.Linear of the blocks in the 5 forwards at their real shapes,
            not the text's K/V, made once a rollout), and the
            forwards with attention removed.
  fidelity  continuing the real clip (bench/common/realvideo.py) after --horizons cached frames: PSNR / SSIM of
            the generated latents of each setting against dense bf16, beside the bf16 noise floor (dense
            fp32 vs dense bf16) and the control that drops the cached history (own chunk only); per
            setting also the share of the dense cache it holds and, where AnnSA runs, its recall and
            density on layers 9 / 19 over the generated chunks.

    python bench/e2e_bench.py --out bench/results        # ~9 minutes on an H200
    python bench/e2e_bench.py --smoke                    # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SENSITIVE, fastar, header, parser, shapes, wall_ms, write_json  # noqa: E402
from common.rollouts import SETTINGS, Fidelity, held_gb, make_run, peak_gb, real_rollout, reset_peak  # noqa: E402
from common.testbed import CHUNK, NoAttention, prefill, testbed  # noqa: E402

# "tempcache" (TempCache alone) is "fastar" (the pack's defaults) while the two agree: run and scored once
SETTINGS = {name: s for name, s in SETTINGS.items() if name != "tempcache" or s != SETTINGS["fastar"]}
FORWARDS = 5  # 4 denoising steps + the clean pass
VIDEO_PER_LATENT = 4  # Wan 2.1's VAE: 4 video frames per latent frame


def dense_point(model, context, cached, hw, reps):
    """One dense chunk after ``cached`` prefilled frames: median ms and peak GB."""
    device = context.device
    reset_peak(device)
    # eager, as in its real rollout, whose growing cache never repeats a chunk (no CUDA graph)
    run = make_run(model, context, cached + CHUNK, hw, "dense", cuda_graphs=False)
    with torch.inference_mode():
        prefill(run, cached)
        run.cache.begin_chunk(cached, CHUNK)
        run.sample_chunk(cached // CHUNK)  # warm-up
        ms = statistics.median(wall_ms(lambda: run.sample_chunk(cached // CHUNK), reps, device))
    return {"frames": cached + CHUNK, "latency_ms": ms, "peak_gb": peak_gb(device), "held_gb": held_gb(device),
            "source": "prefilled"}


def self_attention_ms(model, q_tokens, k_tokens, device, reps):
    """One layer's dense self-attention call (cuDNN through ``attend``)."""
    g = torch.Generator(device=device).manual_seed(2)
    shape = (1, q_tokens, model.num_heads, model.head_dim)
    q = torch.randn(shape, device=device, dtype=model.dtype, generator=g)
    k = torch.randn((1, k_tokens, model.num_heads, model.head_dim), device=device, dtype=model.dtype, generator=g)
    fastar.attend(q, k, k)
    return statistics.median(wall_ms(lambda: fastar.attend(q, k, k), reps, device))


def linear_floor_ms(model, tokens, device, reps):
    """Every nn.Linear of the blocks in one chunk (5 forwards) at its real input shape: the GEMM
    floor. Not the cross-attention's K/V of the text: a rollout makes them once."""
    mods = [mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
            and name.startswith("blocks.") and not (".cross_attn." in name and name.endswith((".k", ".v")))]
    inputs = {n: torch.randn(1, tokens, n, device=device, dtype=model.dtype) for n in {m.in_features for m in mods}}

    def chunk():
        for _ in range(FORWARDS):
            for mod in mods:
                mod(inputs[mod.in_features])
    with torch.inference_mode():
        chunk()
        return statistics.median(wall_ms(chunk, reps, device))


def fidelity(model, model32, context, horizons, hw, gen_frames, settings=SETTINGS, floor_horizons=None):
    """``Fidelity``'s table for every setting: one row per horizon (history_frames, generated_frames,
    noise_floor, own_chunk_only, then each setting's PSNR / SSIM / kv_held and AnnSA's recall / density)."""
    f = Fidelity(model, model32, context, horizons, hw, gen_frames, settings, floor_horizons)
    f.references()
    for names in f.groups():
        f.measure(names)
    return f.table()


def dense_curve(points):
    """Piecewise-linear dense latency at any frame count, from sorted (frames, ms) points."""
    pts = sorted((p["frames"], p["latency_ms"]) for p in points)

    def at(frames):
        if frames <= pts[0][0]:
            return pts[0][1]
        for (f0, t0), (f1, t1) in zip(pts, pts[1:]):
            if frames <= f1:
                return t0 + (t1 - t0) * (frames - f0) / (f1 - f0)
        return pts[-1][1]
    return at


def summarize(result, chunks):
    fa = result["rollouts"]["fastar"]
    # the dense rollout's first chunks carry one-off setup (cuDNN plans, allocator growth): left out
    at = dense_curve(result["rollouts"]["dense"][2:] + result["dense_points"])
    auc_fastar = sum(r["latency_ms"] for r in fa)
    auc_dense = sum(at(r["frames"]) for r in fa)
    rows_240 = [r for r in fa if abs(r["frames"] - 240 // VIDEO_PER_LATENT) <= 2 * CHUNK]
    near_240 = [r["latency_ms"] for r in rows_240]
    last = [r["latency_ms"] for r in fa[-5:]]
    peak_240 = max(r["peak_gb"] for r in rows_240) if rows_240 else float("nan")
    steady = statistics.median(r["latency_ms"] for r in fa[len(fa) // 2:])
    s = {"chunks": chunks, "latent_frames": chunks * CHUNK, "video_frames": chunks * CHUNK * VIDEO_PER_LATENT,
         "auc_fastar_s": auc_fastar / 1e3, "auc_dense_s": auc_dense / 1e3, "speedup_auc": auc_dense / auc_fastar,
         "fastar_ms_near_video_frame_240": statistics.median(near_240) if near_240 else float("nan"),
         "fastar_ms_last5": statistics.median(last),
         "flatness_last_over_240": statistics.median(last) / statistics.median(near_240) if near_240 else float("nan"),
         "peak_gb_near_240": peak_240, "peak_gb_last": max(r["peak_gb"] for r in fa[-5:]),
         "held_gb_near_240": max(r["held_gb"] for r in rows_240) if rows_240 else float("nan"),
         "held_gb_last": max(r["held_gb"] for r in fa[-5:]),
         "fastar_steady_ms": steady, "linear_floor_ms": result["floor"]["linear_ms"],
         "steady_over_linear_floor": steady / result["floor"]["linear_ms"]}
    s["peak_last_over_240"] = s["peak_gb_last"] / s["peak_gb_near_240"]
    s["held_last_over_240"] = s["held_gb_last"] / s["held_gb_near_240"]
    return s


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_f, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, rows in result["rollouts"].items():
        x = [VIDEO_PER_LATENT * r["frames"] for r in rows]
        fps = [VIDEO_PER_LATENT * CHUNK / (r["latency_ms"] / 1e3) for r in rows]
        ax_f.plot(x, fps, "-", lw=1, label=f"{name} (rollout)")
        ax_m.plot(x, [r["held_gb"] for r in rows], "-", lw=1, label=f"{name} (rollout)")
    pts = result["dense_points"]
    for src, marker in (("prefilled", "o"), ("composed", "s")):
        sel = [p for p in pts if p["source"] == src]
        if sel:
            x = [VIDEO_PER_LATENT * p["frames"] for p in sel]
            ax_f.plot(x, [VIDEO_PER_LATENT * CHUNK / (p["latency_ms"] / 1e3) for p in sel], marker, color="k",
                      label=f"dense ({src} cache)")
            ax_m.plot(x, [p["held_gb"] for p in sel], marker, color="k", label=f"dense ({src} cache)")
    ax_f.set(xlabel="video frames generated", ylabel="video frames per second", title="throughput", yscale="log")
    ax_m.set(xlabel="video frames generated", ylabel="peak GB held during the chunk (CUDA graph pools included)",
             title="peak memory")
    for ax in (ax_f, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    s = result["summary"]
    fig.suptitle(f"Wan 2.1 1.3B shapes, 480x832, bf16, random weights (sensitized), {result['device']}, "
                 f"{result['date']}: FAST-AR x{s['speedup_auc']:.1f} over dense across {s['video_frames']} frames",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--chunks", type=int, default=240, help="FAST-AR rollout length (240 chunks = 2880 frames)")
    ap.add_argument("--component-chunks", type=int, default=40)
    ap.add_argument("--dense-chunks", type=int, default=27)
    ap.add_argument("--dense-points", default="81,240,450")
    ap.add_argument("--compose-frames", type=int, default=720)
    ap.add_argument("--horizons", default="21,81")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", choices=("random", "wan"), default="random",
                    help="text context: a Gaussian stand-in, or the real clip's prompt (bench/common/testbed.prompt_context)")
    ap.add_argument("--skip-fidelity", action="store_true", help="speed and memory only (no fidelity table)")
    ap.add_argument("--fidelity-only", action="store_true",
                    help="only the fidelity table (~2.5 min on an H200), written as e2e_fidelity.json")
    args = ap.parse_args()
    device, size, hw = shapes(args.smoke)
    if args.smoke:
        args.chunks, args.component_chunks, args.dense_chunks = 24, 4, 4
        args.dense_points, args.compose_frames, args.horizons, args.reps = "15,21", 30, "6,9", 1
    if not args.skip_fidelity:
        model32, context32 = testbed(dtype=torch.float32, size=size, device=str(device), prompt=args.prompt)
    model, context = testbed(dtype=torch.bfloat16, size=size, device=str(device), prompt=args.prompt)
    tokens = CHUNK * (hw[0] // 16) * (hw[1] // 16)
    result = {**header(device),
              "shapes": {"height": hw[0], "width": hw[1], "chunk_frames": CHUNK, "tokens_per_chunk": tokens,
                         "forwards_per_chunk": FORWARDS, "model": size, "dtype": "bfloat16"},
              "testbed": {"sensitized": SENSITIVE, "weights": "random (no Wan weights exist here)",
                          "prompt": args.prompt},
              "cuda_graphs": "chunks whose Python-level work repeats the previous chunk's replay a CUDA graph "
                             "(fastar.rollout)",
              "settings": {k: [repr(c), repr(a)] for k, (c, a) in SETTINGS.items()}}
    tic = time.time()

    if not args.skip_fidelity:
        result["fidelity"] = fidelity(model, model32, context32.to(model.dtype),
                                      [int(h) for h in args.horizons.split(",")], hw, 2 * CHUNK)
        print(f"[{time.time() - tic:.0f} s] fidelity done", flush=True)
        del model32, context32
    if args.fidelity_only:
        write_json(args.out, "e2e_fidelity" + ("_smoke" if args.smoke else "") + ".json", result)
        return

    result["floor"] = {"linear_ms": linear_floor_ms(model, tokens, device, args.reps)}
    run = make_run(model, context, CHUNK, hw, "dense", NoAttention)
    with torch.inference_mode():
        run.cache.begin_chunk(0, CHUNK)
        run.sample_chunk(0)
        run.sample_chunk(0)  # the same chunk again: captured as a CUDA graph, replayed by the timed calls
        result["floor"]["no_attention_ms"] = statistics.median(wall_ms(lambda: run.sample_chunk(0), args.reps,
                                                                       device))
    del run  # its cache, graph and text K/V would otherwise count in every later rollout's allocated peak
    print(f"[{time.time() - tic:.0f} s] floor: {result['floor']}", flush=True)

    real_rollout(model, context, 2, hw, "fastar")  # warm-up: Triton compiles, cuDNN plans
    rollouts = {"fastar": real_rollout(model, context, args.chunks, hw, "fastar")}
    for name in (n for n in ("tempcache", "annsa", "annca", "sink+window") if n in SETTINGS):
        rollouts[name] = real_rollout(model, context, args.component_chunks, hw, name)
    rollouts["dense"] = real_rollout(model, context, args.dense_chunks, hw, "dense")
    result["rollouts"] = rollouts
    print(f"[{time.time() - tic:.0f} s] rollouts done", flush=True)

    points = [dense_point(model, context, int(n), hw, args.reps) for n in args.dense_points.split(",")]
    for p in points:
        print(f"  dense prefilled to {p['frames'] - CHUNK} frames: {p['latency_ms']:.1f} ms, "
              f"peak {p['peak_gb']:.1f} GB")
    last = points[-1]
    tpf = tokens // CHUNK
    a_last = self_attention_ms(model, tokens, last["frames"] * tpf, device, args.reps)
    a_comp = self_attention_ms(model, tokens, (args.compose_frames + CHUNK) * tpf, device, args.reps)
    kv_gb_per_frame = 2 * model.num_layers * tpf * model.num_heads * model.head_dim * 2 / 1e9
    points.append({"frames": args.compose_frames + CHUNK, "source": "composed",
                   "latency_ms": last["latency_ms"] + FORWARDS * model.num_layers * (a_comp - a_last),
                   "peak_gb": last["peak_gb"] + kv_gb_per_frame * (args.compose_frames + CHUNK - last["frames"]),
                   "held_gb": last["held_gb"] + kv_gb_per_frame * (args.compose_frames + CHUNK - last["frames"]),
                   "self_attention_ms": {"at_last_point": a_last, "at_composed": a_comp}})
    result["dense_points"] = points
    print(f"  dense composed at {args.compose_frames} frames: {points[-1]['latency_ms']:.1f} ms, "
          f"{points[-1]['peak_gb']:.1f} GB (not held by any card)")

    result["summary"] = summarize(result, args.chunks)
    print("summary:", {k: round(v, 3) if isinstance(v, float) else v for k, v in result["summary"].items()})
    tag = "e2e_bench_smoke" if args.smoke else "e2e_bench"
    write_json(args.out, tag + ".json", result)
    plot(result, os.path.join(args.out, tag + ".png"))
    print(f"[{time.time() - tic:.0f} s] wrote {os.path.join(args.out, tag)}.json/.png")


if __name__ == "__main__":
    main()
