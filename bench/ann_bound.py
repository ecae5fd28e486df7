"""The sparse-kernel bound of the AnnSA issue, planning included, at every cached length it names.

For 21 / 81 / 240 cached real frames (the Wan clip through the sensitized 1.3B-shaped testbed,
Gaussian prompt, layer 9) and key densities d of 0.5 / 0.25 / 0.125, the default AnnSA (quant) runs with
the keep fraction that reads d of the keys (own chunk included):

    time = plan + sparse kernel   against   bound = 1.4 * d * T_cudnn + 0.05 * T_cudnn

with T_cudnn the dense cuDNN call over the same keys, all timed side by side (bench/common/annsa.measure),
two ways: GPU time (the whole call, plan included, and the dense call, each replayed from a CUDA graph,
taking turns over five rounds: what a call costs in a rollout, where the host runs ahead of the GPU)
and eager (plan and kernel timed apart with CUDA events, so an idle GPU also waits for the host's
launches). The verdict is on GPU time, as the median over rounds of time / T_cudnn against
1.4 * d + 0.05; the eager one is reported next to it. A density below the own chunk's share (3 of 24 frames at
21) is not reachable and is listed as such. Writes ann_bound.json.

    python bench/ann_bound.py --out bench/results        # about 2 minutes on an H200
    python bench/ann_bound.py --smoke --out /tmp         # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, shapes, write_json  # noqa: E402
from common.annsa import measure  # noqa: E402
from common.testbed import CHUNK, capture, testbed  # noqa: E402


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--frames", default="21,81,240", help="cached frames")
    ap.add_argument("--densities", default="0.5,0.25,0.125")
    ap.add_argument("--layer", type=int, default=9)
    args = ap.parse_args()
    device, size, hw = shapes(args.smoke)
    if args.smoke:
        args.frames, args.layer = "6,12", 1
    model, context = testbed(size=size, device=str(device), prompt="random")
    rows = []
    for frames in (int(f) for f in args.frames.split(",")):
        kv, clean_q, query_q, _ = capture(model, context, frames, [args.layer], height=hw[0], width=hw[1])
        for d in (float(x) for x in args.densities.split(",")):
            keep = (d * (frames + CHUNK) - CHUNK) / frames  # share of the history that makes density d
            row = {"cached_frames": frames, "target_density": d, "keep_fraction": keep}
            if keep <= 0:
                row["reachable"] = False
                print(f"{frames:3d} frames d={d}: below the own chunk's share {CHUNK / (frames + CHUNK):.3f}")
            else:
                cfg = fastar.AnnConfig(keep_fraction=min(keep, 1.0), keep_mass=0.0)
                r = measure(cfg, kv, args.layer, clean_q, query_q, frames)
                t, t_dense, ratio = r["call_graph_ms"], r["dense_graph_ms"], r["call_over_dense_graph"]
                bound_ratio = 1.4 * r["density"] + 0.05  # the bound in units of T_cudnn
                bound, within = bound_ratio * t_dense, ratio <= bound_ratio
                t_eager, t_dense_eager = r["plan_ms"] + r["sparse_ms"], r["dense_cudnn_ms"]
                bound_eager = bound_ratio * t_dense_eager
                row.update(reachable=True, density=r["density"], recall=r["recall"], call_gpu_ms=t,
                           dense_gpu_ms=t_dense, call_over_dense=ratio, bound_over_dense=bound_ratio,
                           bound_ms=bound, within_bound=within,
                           plan_ms=r["plan_ms"], sparse_ms=r["sparse_ms"], dense_cudnn_ms=t_dense_eager,
                           bound_eager_ms=bound_eager, within_bound_eager=t_eager <= bound_eager)
                print(f"{frames:3d} frames d={d} (keep {keep:.3f}): density {r['density']:.3f} recall "
                      f"{r['recall']:.3f}  GPU {t:.2f} ms against bound {bound:.2f} (dense {t_dense:.2f}; "
                      f"ratio {ratio:.3f} against {bound_ratio:.3f}): "
                      f"{'within' if within else 'OVER'};  eager plan {r['plan_ms']:.2f} + sparse "
                      f"{r['sparse_ms']:.2f} = {t_eager:.2f} against {bound_eager:.2f}: "
                      f"{'within' if t_eager <= bound_eager else 'OVER'}", flush=True)
            rows.append(row)
        del kv, clean_q, query_q
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {**header(device), "layer": args.layer, "prompt": "random", "rows": rows}
    write_json(args.out, "ann_bound" + ("_smoke" if args.smoke else "") + ".json", result)


if __name__ == "__main__":
    main()
