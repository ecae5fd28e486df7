"""AnnSA on the H200: recall, density and time of its fixed-share plans on real-video queries and keys.

Keys, values and queries come from the same teacher-forced pass as bench/tempcache_bench.py (the three real
clips through the 1.3B-shaped model, 81 cached frames; the next chunk's queries at sigma 0.625). For each
keep fraction of the quant plan (``keep_mass`` 0: each query block reads that share of the history's key
blocks), each measured layer's history is written into an unbounded cache through the cache protocol, AnnSA
indexes it after every clean pass, and the next chunk's queries are planned and attended:
  recall    dense attention mass inside the plan's key ranges (every query block), and of the history's
            share alone
  density   keys read / keys, over all query blocks
  time      planning (block scores + selection) and the sparse kernel, against cuDNN dense, eagerly and as
            GPU time of CUDA-graph replays; the planning kernels against their torch twins on these plans
and, for AnnCA, the same layers' cross-attention over the real clip's prompt (bench/common/testbed.prompt_context):
kept-token density, the dense cross-attention mass on the kept tokens, output error and op time.

    python bench/ann_bench.py --out bench/results      # JSON + PNG
    python bench/ann_bench.py --smoke                  # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, op_ms, parser, shapes, write_json  # noqa: E402
from common.annsa import measure  # noqa: E402
from common.testbed import CHUNK, capture, testbed  # noqa: E402

from comfyui_fastar.fastar.annsa import KEY_BLOCK  # noqa: E402
from comfyui_fastar.fastar.attention import build_ann  # noqa: E402

AnnConfig, CacheConfig, make_cache, attend = fastar.AnnConfig, fastar.CacheConfig, fastar.make_cache, fastar.attend


def measure_annca(cfg, cross, layer, tokens_per_frame, device):
    """AnnCA on one layer's recorded cross-attention (q [1, n, H, D] over the prompt's k / v)."""
    q, k, v = cross[layer]
    kv = make_cache(CacheConfig("unbounded"), num_layers=1, batch=1, num_heads=q.shape[2], head_dim=q.shape[3],
                    tokens_per_frame=tokens_per_frame, chunk_frames=CHUNK, max_frames=CHUNK, device=device,
                    dtype=q.dtype)
    _, annca = build_ann(dataclasses.replace(cfg, annsa=False, annca=True), kv)
    keep = annca.keep(0, q, k)                                                     # [B, H, F, Lc]
    logits = torch.einsum("bnhd,bchd->bhnc", q.float(), k.float()) / q.shape[-1] ** 0.5
    frame_keep = keep.repeat_interleave(tokens_per_frame, dim=2)                   # [B, H, n, Lc]
    recall = (logits.softmax(-1) * frame_keep).sum(-1).mean().item()
    out, dense = annca.attention(0, q, k, v), attend(q, k, v)
    err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
    t_sparse = op_ms(lambda: annca.attention(0, q, k, v), device)
    t_dense = op_ms(lambda: attend(q, k, v), device)
    return {"density": keep.float().mean().item(), "recall": recall, "rel_error": err, "annca_ms": t_sparse,
            "dense_cudnn_ms": t_dense, "speedup": t_dense / t_sparse}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    rows = result["settings"]
    density = [r["density"] for r in rows]
    ax.scatter(density, [r["recall"] for r in rows], marker="s", label="recall")
    ax.scatter(density, [r["history_recall"] for r in rows], marker="o", label="recall of the history's share")
    bx.scatter(density, [r["speedup_incl_plan"] for r in rows], marker="s")
    for r in rows:
        ax.annotate(f"keep {r['keep_fraction']:g}", (r["density"], r["recall"]), fontsize=7)
    ax.axhline(0.93, color="gray", ls="--", lw=0.8, label="recall target 0.93")
    ax.set(xlabel="key density (keys read / keys)", ylabel="recall of dense attention mass",
           title=f"AnnSA, {result['history_frames']} cached real frames")
    bx.axhline(1.0, color="gray", ls="--", lw=0.8)
    bx.set(xlabel="key density", ylabel="speedup over cuDNN dense (planning included)", title="AnnSA time")
    ax.legend()
    fig.suptitle(f"Wan 1.3B shapes, sensitized random weights, bf16; {result['device']}, {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--history-frames", type=int, default=81)
    ap.add_argument("--layers", default="9,19")
    ap.add_argument("--tag", default="ann_bench", help="name of the JSON / PNG written")
    ap.add_argument("--quant-keep", default="0.125,0.25,0.35,0.5", help="quant keep fractions")
    ap.add_argument("--annca-bits", default="8", help="AnnCA bit counts (probes and min_tokens at their defaults)")
    ap.add_argument("--prompt", default="wan", choices=("wan", "random"),
                    help="wan: the real clip's prompt (bench/common/testbed.prompt_context); random: a Gaussian one")
    args = ap.parse_args()
    device, size, hw = shapes(args.smoke)
    if args.smoke:
        args.history_frames, args.layers, args.tag = 6, "0", args.tag + "_smoke"
    model, context = testbed(size=size, device=str(device), prompt=args.prompt)
    layers = [int(x) for x in args.layers.split(",")]
    kv_dense, clean_q, query_q, cross = capture(model, context, args.history_frames, layers, height=hw[0], width=hw[1])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for keep in (float(f) for f in args.quant_keep.split(",") if f):
        cfg = AnnConfig(keep_fraction=keep, keep_mass=0.0)
        per_layer = [measure(cfg, kv_dense, layer, clean_q, query_q, args.history_frames) for layer in layers]
        row = {"keep_fraction": keep, "block_q": cfg.block_q,
               **{k: statistics.mean(r[k] for r in per_layer) for k in per_layer[0] if not isinstance(per_layer[0][k], bool)},
               "per_layer": per_layer}
        rows.append(row)
        print(f"quant keep {keep:g}: recall {row['recall']:.3f} (history {row['history_recall']:.3f}) density "
              f"{row['density']:.3f} err {row['rel_error']:.3f} ranges {row['ranges_per_block']:.0f} plan "
              f"{row['plan_ms']:.2f} ms sparse {row['sparse_ms']:.2f} ms dense {row['dense_cudnn_ms']:.2f} ms "
              f"speedup {row['speedup_incl_plan']:.2f}x", flush=True)
    annca = []
    for bits in (int(b) for b in args.annca_bits.split(",") if b):
        cfg = AnnConfig(bits=bits, probes=min(AnnConfig.probes, bits))
        per_layer = [measure_annca(cfg, cross, layer, kv_dense.tokens_per_frame, device) for layer in layers]
        row = {"bits": cfg.bits, "probes": cfg.probes, "min_tokens": cfg.min_tokens,
               **{k: statistics.mean(r[k] for r in per_layer) for k in per_layer[0]}, "per_layer": per_layer}
        annca.append(row)
        print(f"AnnCA bits {cfg.bits:2d} probes {cfg.probes}: kept {row['density']:.3f} recall {row['recall']:.3f} "
              f"err {row['rel_error']:.3f} {row['annca_ms']:.3f} ms vs dense {row['dense_cudnn_ms']:.3f} ms "
              f"({row['speedup']:.2f}x)", flush=True)
    result = {**header(device), "history_frames": args.history_frames, "layers": layers,
              "inputs": "real clips via bench/common/realvideo.real_latents, 1.3B-shaped model (random weights, sensitized: "
                        "bench/common/testbed.py, bf16), next chunk's queries at sigma 0.625; prompt: " + args.prompt,
              "key_block": KEY_BLOCK, "settings": rows, "annca": annca}
    write_json(args.out, args.tag + ".json", result)
    plot(result, os.path.join(args.out, args.tag + ".png"))


if __name__ == "__main__":
    main()
