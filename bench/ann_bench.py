"""AnnSA on the H200: recall, density and time on real-video queries and keys, lsh against quant.

Keys, values and queries come from the same teacher-forced pass as bench/tempcache_bench.py (the three real
clips through the 1.3B-shaped model, 81 cached frames; the next chunk's queries at sigma 0.625). For each
setting, each measured layer's history is written into an unbounded cache through the cache protocol, AnnSA
hashes and bucket-sorts it after every clean pass, and the next chunk's queries are planned and attended:
  recall    dense attention mass inside the plan's key ranges (every query block)
  density   keys read / keys, over all query blocks
  time      planning (hash + sort queries + range lists) and the sparse kernel, against cuDNN dense

    python bench/ann_bench.py --out bench/results
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pkg import fastar  # noqa: E402
from testbed import CHUNK, TPF, capture, testbed  # noqa: E402
from timing import cuda_ms  # noqa: E402

from comfyui_fastar.fastar.ann import build_ann, plan_density  # noqa: E402

AnnConfig, CacheConfig, KVCache, attend = fastar.AnnConfig, fastar.CacheConfig, fastar.KVCache, fastar.attend


def measure(cfg, kv_dense, layer, clean_q, query_q, history_frames):
    heads, d = kv_dense.num_heads, kv_dense.head_dim
    kv = KVCache(CacheConfig("unbounded"), num_layers=1, batch=1, num_heads=heads, head_dim=d, tokens_per_frame=TPF,
                 chunk_frames=CHUNK, max_frames=history_frames + CHUNK, device="cuda", dtype=kv_dense.dtype)
    annsa, _ = build_ann(dataclasses.replace(cfg, annca=False), kv)
    for c in range(history_frames // CHUNK):
        span = slice(c * CHUNK * TPF, (c + 1) * CHUNK * TPF)
        kv.begin_chunk(c * CHUNK, CHUNK)
        kv.begin_clean_pass()
        kv.extend(0, kv_dense.k[layer, :, span], kv_dense.v[layer, :, span])
        kv.after_attention(0, clean_q[layer][c])
        annsa.index_history(0)
        kv.commit()
    own = slice(history_frames * TPF, (history_frames + CHUNK) * TPF)
    kv.begin_chunk(history_frames, CHUNK)
    keys, values, bias = kv.extend(0, kv_dense.k[layer, :, own], kv_dense.v[layer, :, own])
    q = query_q[layer]
    plan = annsa.plan(0, q)
    recall = annsa.recall(q, keys, bias, plan, sample_blocks=10**6).item()  # every query block
    density = plan_density(plan[1], plan[2], keys.shape[1]).item()
    out = annsa.attention(0, q, keys, values, bias, plan)
    dense = attend(q, keys, values)
    err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
    t_plan = cuda_ms(lambda: annsa.plan(0, q))
    t_sparse = cuda_ms(lambda: annsa.attention(0, q, keys, values, bias, plan))
    t_dense = cuda_ms(lambda: attend(q, keys, values))
    return {"recall": recall, "density": density, "rel_error": err, "plan_ms": t_plan, "sparse_ms": t_sparse,
            "dense_cudnn_ms": t_dense, "speedup_incl_plan": t_dense / (t_plan + t_sparse)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--history-frames", type=int, default=81)
    ap.add_argument("--layers", default="9,19")
    ap.add_argument("--tag", default="ann_bench", help="name of the JSON written")
    ap.add_argument("--lsh", default="6:0,6:2,8:0,8:2,10:0,10:2", help="lsh settings as bits:probes,...")
    ap.add_argument("--block-q128", type=int, default=2, help="how many of the block_q=128 lsh settings to run")
    ap.add_argument("--quant-keep", default="0.125,0.25,0.5", help="quant keep fractions")
    ap.add_argument("--plain", action="store_true", help="the plain random init instead of bench/testbed's "
                                                           "sensitized one")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, context = testbed(sensitive=not args.plain)
    layers = [int(x) for x in args.layers.split(",")]
    kv_dense, clean_q, query_q = capture(model, context, args.history_frames, layers)
    del model
    torch.cuda.empty_cache()
    settings = [AnnConfig(bits=int(b), probes=int(p)) for b, p in (x.split(":") for x in args.lsh.split(","))]
    settings += [AnnConfig(bits=8, probes=2, block_q=128), AnnConfig(bits=8, probes=0, block_q=128)][:args.block_q128]
    settings += [AnnConfig(method="quant", keep_fraction=float(f)) for f in args.quant_keep.split(",")]
    rows = []
    for cfg in settings:
        per_layer = [measure(cfg, kv_dense, layer, clean_q, query_q, args.history_frames) for layer in layers]
        row = {"method": cfg.method, "bits": cfg.bits, "probes": cfg.probes, "block_q": cfg.block_q,
               "keep_fraction": cfg.keep_fraction,
               **{k: statistics.mean(r[k] for r in per_layer) for k in per_layer[0]}, "per_layer": per_layer}
        rows.append(row)
        print(f"{cfg.method:5s} bits {cfg.bits:2d} probes {cfg.probes} bq {cfg.block_q:3d} keep {cfg.keep_fraction:5.3f}: "
              f"recall {row['recall']:.3f} density {row['density']:.3f} err {row['rel_error']:.3f} "
              f"plan {row['plan_ms']:.2f} ms sparse {row['sparse_ms']:.2f} ms dense {row['dense_cudnn_ms']:.2f} ms "
              f"speedup {row['speedup_incl_plan']:.2f}x", flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "history_frames": args.history_frames, "layers": layers,
              "inputs": "real clips via bench/realvideo.real_latents, 1.3B-shaped model (random weights"
                        + ("" if args.plain else ", sensitized: bench/testbed.py") + ", bf16), "
                        "next chunk's queries at sigma 0.625", "settings": rows}
    with open(os.path.join(args.out, args.tag + ".json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
