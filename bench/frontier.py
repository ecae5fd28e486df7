"""Speed against fidelity beyond the defaults: FAST-AR at its defaults and with the three knobs that set its
attention work turned down, alone and together: AnnSA's top-p mass (0.9 instead of 0.95), no dense first step
(``dense_steps_fraction`` 0 instead of 0.3) and TempCache's budget (12 frames instead of 21); and AnnSA's plan
read two other ways: the fixed share (top-k: ``keep_mass`` 0, ``keep_fraction`` 0.35) and top-p over a floor of
0.1 instead of 0.2. For each: the per-chunk latency of a rollout (14 chunks, median of the last 5, side by side in
one run; the ratio to the defaults) and the fidelity after 81 real cached frames (e2e_bench's table: PSNR / SSIM
against dense bf16 beside the noise floor and the own-chunk control, AnnSA's recall and density on the generated
chunks). Writes frontier.json.

    python bench/frontier.py --out bench/results     # about 4 minutes on an H200
    python bench/frontier.py --smoke --out /tmp      # tiny model on the CPU: checks the script only
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_bench as E  # noqa: E402
from common import fastar, header, parser, shapes, write_json  # noqa: E402
from testbed import testbed  # noqa: E402


def settings() -> dict:
    """name -> (cache, ann); "dense" is the fidelity's reference (not timed here: e2e_bench times it)."""
    A, T = fastar.AnnConfig, fastar.TempCacheConfig
    return {
        "dense": (fastar.CacheConfig("unbounded"), None),
        "fastar": (T(), A()),
        "mass.9": (T(), A(keep_mass=0.9)),
        "no_dense_step": (T(), A(dense_steps_fraction=0.0)),
        "budget12": (T(max_cache_frames=12), A()),
        "no_dense_step+mass.9": (T(), A(dense_steps_fraction=0.0, keep_mass=0.9)),
        "all_three": (T(max_cache_frames=12), A(dense_steps_fraction=0.0, keep_mass=0.9)),
        "top-k.35": (T(), A(keep_fraction=0.35, keep_mass=0.0)),
        "top-p.95/.1": (T(), A(keep_fraction=0.1)),
    }


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--chunks", type=int, default=14, help="chunks per timed rollout (median of the last 5)")
    ap.add_argument("--horizon", type=int, default=81, help="real cached frames before the fidelity's generation")
    args = ap.parse_args()
    device, size, hw = shapes(args.smoke)
    if args.smoke:
        args.chunks, args.horizon = 4, 9
    table = settings()
    model, ctx = testbed(size=size, device=str(device))
    model32, ctx32 = testbed(dtype=torch.float32, size=size, device=str(device))
    E.real_rollout(model, ctx, 2, hw, "fastar", settings=table)  # warm-up: Triton compiles, cuDNN plans

    result = {**header(device), "chunks": args.chunks, "horizon_frames": args.horizon, "settings": {}}
    for name in (n for n in table if n != "dense"):
        rows = E.real_rollout(model, ctx, args.chunks, hw, name, log_every=100, settings=table)
        result["settings"][name] = E.steady_state(rows)
    base = result["settings"]["fastar"]["ms"]
    for row in result["settings"].values():
        row["vs_defaults"] = row["ms"] / base
    (fid,) = E.fidelity(model, model32, ctx32.to(model.dtype), [args.horizon], hw, 2 * E.CHUNK, settings=table)
    result["fidelity"] = fid
    for name, row in result["settings"].items():
        f = fid[name]
        print(f"{name:24s} {row['ms']:8.1f} ms/chunk  x{row['vs_defaults']:.3f} of the defaults  "
              f"PSNR {f['psnr']:.1f} dB  SSIM {f['ssim']:.4f}"
              + (f"  recall {f['annsa_recall']:.3f} @ {f['annsa_density']:.3f}" if "annsa_recall" in f else ""),
              flush=True)
    write_json(args.out, "frontier_smoke.json" if args.smoke else "frontier.json", result)


if __name__ == "__main__":
    main()
