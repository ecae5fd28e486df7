"""TempCache's folded read on FlashAttention-4 by fold width and tile, against FA4 dense, per key.

The key fold (``kernels/flash4.py``) carries log m in two extra key channels padded to 16: FA4 then
runs at head dim 144, whose 288-byte rows take a 32-byte shared-memory swizzle (128 takes 128 bytes).
This times, at TempCache's layout (sink 3 + the open chunk 3 unbiased, then F history frames with a
log m bias; 4680 queries, 12 heads x 128, bf16), the fold padded to 16 / 32 / 64 channels (head dims
144 / 160 / 192: 32-, 64- and 128-byte swizzles) at FA4's default tiles and at others, beside FA4 dense
over the same keys and the per-call fold of the queries. CUDA-graph replays, paths taking turns,
medians; error against fp32 math on 256 sampled queries.

    python bench/fold_tiles.py --out bench/results
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import header, parser, write_json  # noqa: E402
from common.attention import D, FIXED, H, LQ, inputs, reference, rel, timed  # noqa: E402
from comfyui_fastar.kernels import flash4  # noqa: E402

#: name -> (channels added, FA4 tile (m, n) or None for its default, mma_pv_is_rs or None, intra_wg_overlap or None)
VARIANTS = {
    "fold16": (16, None, None, None),
    "fold16_n112": (16, (128, 112), None, None),
    "fold16_n96": (16, (128, 96), None, None),
    "fold16_smem_p": (16, None, False, None),
    "fold32": (32, None, None, None),
    "fold32_n112": (32, (128, 112), None, None),
    "fold64": (64, None, None, None),
}


def fold(q, k, bias, pad):
    """(q', k') at head dim D + pad: ``flash4``'s fold (D + 16 channels), widened with zero channels."""
    qp, kp = flash4.fold_bias_into_keys(q, k, bias)
    extra = (0, pad - flash4.KEY_PAD)
    return torch.nn.functional.pad(qp, extra), torch.nn.functional.pad(kp, extra)


def main():
    ap = parser(__doc__)
    ap.add_argument("--frames", default="9,18,78", help="history frames F (TempCache 12 / 21 / 81)")
    ap.add_argument("--only", default="", help="comma-separated variants (default all)")
    args = ap.parse_args()
    interface, _ = flash4.modules()
    variants = {n: v for n, v in VARIANTS.items() if not args.only or n in args.only.split(",")}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randperm(LQ, generator=torch.Generator().manual_seed(1))[:256].cuda()
    scale = D ** -0.5
    result = {**header("cuda"), "shape": {"queries": LQ, "heads": H, "head_dim": D, "fixed_keys": FIXED},
              "variants": {n: {"pad": v[0], "tile_mn": v[1], "mma_pv_is_rs": v[2], "intra_wg_overlap": v[3]}
                           for n, v in variants.items()}, "rows": []}
    with torch.inference_mode():
        for frames in (int(f) for f in args.frames.split(",")):
            q, k, v, bias = inputs(frames, g)
            fns = {"dense": lambda: interface._flash_attn_fwd(q, k, v, softmax_scale=scale)[0],
                   "fold_q": lambda: flash4.fold_queries(q)}
            for name, (pad, tile, rs, ol) in variants.items():
                qp, kp = fold(q, k, bias, pad)
                fns[name] = (lambda qp=qp, kp=kp, tile=tile, rs=rs, ol=ol: interface._flash_attn_fwd(
                    qp, kp, v, softmax_scale=scale, tile_mn=tile, mma_pv_is_rs=rs, intra_wg_overlap=ol)[0])
            ref, ref0 = reference(q, k, v, bias, rows), reference(q, k, v, torch.zeros_like(bias), rows)
            row = {"frames": frames, "keys": k.shape[1], "err": {}, "ms": {}}
            for name, fn in list(fns.items()):
                try:
                    out = fn()
                    if name != "fold_q":
                        row["err"][name] = rel(out, ref0 if name == "dense" else ref, rows)
                except Exception as e:  # noqa: BLE001 - a tile FA4 does not build is reported, not fatal
                    print(f"  {name} failed at F {frames}: {type(e).__name__}: {str(e)[:200]}")
                    del fns[name]
            row["ms"] = timed(fns)
            base = row["ms"]["dense"]
            row["vs_dense"] = {n: ms / base for n, ms in row["ms"].items()}
            print(f"F {frames:3d} ({k.shape[1]} keys): " + "  ".join(
                f"{n} {ms:.3f} ({ms / base:.3f}x{', err %.4f' % row['err'][n] if n in row['err'] else ''})"
                for n, ms in row["ms"].items()))
            result["rows"].append(row)
            del q, k, v, bias
            torch.cuda.empty_cache()
    print("wrote", write_json(args.out, "fold_tiles.json", result))


if __name__ == "__main__":
    main()
