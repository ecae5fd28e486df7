"""Block-sparse attention kernel on the GPU: correctness against its twin, speed against cuDNN SDPA.

Shapes of Wan 2.1 1.3B: 4680 queries (a 3-frame chunk), 12 heads x 128, bf16, keys of 24/84/243
frames of 1560 tokens. Dense mode (every query block reads all keys) against cuDNN over the same
keys, for a few launch configurations; then fixed key densities (random non-overlapping segments
per query block, the chunk's own keys always included) against density x T_cudnn. Planning (ANN
hashing and range lists) is not part of these timings.

    python bench/block_sparse_bench.py --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pkg  # noqa: E402,F401
from timing import cuda_ms  # noqa: E402
from comfyui_fastar.kernels import block_sparse_attention as bsa  # noqa: E402

TPF, Q, H, D = 1560, 3 * 1560, 12, 128


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def segment_ranges(lk, own, n_qb, density, segments, g):
    """Per query block: `segments` random non-overlapping history segments covering `density` of
    the history, plus the own-chunk keys [lk - own, lk)."""
    hist = lk - own
    seg = max(1, int(hist * density) // segments)
    slots = hist // seg
    ranges = torch.zeros(1, H, n_qb, segments + 1, 2, dtype=torch.int32)
    for h in range(H):
        for i in range(n_qb):
            pick = torch.randperm(slots, generator=g)[:segments].sort().values
            ranges[0, h, i, :segments, 0] = (pick * seg).int()
            ranges[0, h, i, :segments, 1] = (pick * seg + seg).int()
            ranges[0, h, i, segments] = torch.tensor([hist, lk], dtype=torch.int32)
    counts = torch.full((1, H, n_qb), segments + 1, dtype=torch.int32)
    return ranges.cuda(), counts.cuda(), (segments * seg + own) / lk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": __import__("triton").__version__}

    # correctness on the GPU: kernel vs twin on fresh random small cases
    errs = []
    for case in range(40):
        lq, lk = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 500, (1,), generator=g))
        d = [64, 128][case % 2]
        q = torch.randn(1, 2, lq, d, dtype=torch.bfloat16).cuda()
        k = torch.randn(1, 2, lk, d, dtype=torch.bfloat16).cuda()
        v = torch.randn(1, 2, lk, d, dtype=torch.bfloat16).cuda()
        bias = (torch.randn(1, 2, lk) if case % 3 else torch.zeros(1, 2, lk)).cuda()
        ranges, counts = bsa.dense_ranges(1, 2, lq, lk, 64, device="cuda")
        out = bsa.block_sparse_attention(q, k, v, ranges, counts, key_bias=bias, block_q=64)
        ref = bsa.block_sparse_attention_torch(q.float(), k.float(), v.float(), ranges, counts, key_bias=bias,
                                               block_q=64)
        errs.append(rel(out, ref))
    result["gpu_kernel_vs_twin_max_rel_err"] = max(errs)
    print(f"kernel vs twin on GPU, 40 cases: max rel err {max(errs):.2e}")

    q = torch.randn(1, Q, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    dense_rows = []
    for frames in (24, 84, 243):
        lk = frames * TPF
        kv = torch.randn(2, 1, lk, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v)
            t_cudnn = cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        flops = 4 * Q * lk * H * D
        best = None
        for block_q, block_n, warps, stages in [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                                (128, 64, 8, 4), (128, 32, 4, 3)]:
            ranges, counts = bsa.dense_ranges(1, H, Q, lk, block_q, device="cuda")
            try:
                def call():
                    return bsa.block_sparse_attention(q, k, v, ranges, counts, block_q=block_q, block_n=block_n,
                                                      num_warps=warps, num_stages=stages)
                err = rel(call(), ref)
                t = cuda_ms(call)
            except Exception as exc:  # a configuration that does not compile or fit
                print(f"  {frames} frames {(block_q, block_n, warps, stages)}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            row = {"frames": frames, "config": [block_q, block_n, warps, stages], "ms": t, "rel_err": err,
                   "tflops": flops / t / 1e9, "cudnn_ms": t_cudnn, "cudnn_tflops": flops / t_cudnn / 1e9,
                   "ratio_to_cudnn_tflops": t_cudnn / t}
            dense_rows.append(row)
            print(f"dense {frames:3d} frames cfg {row['config']}: {t:7.3f} ms ({row['tflops']:.0f} TFLOP/s) "
                  f"cuDNN {t_cudnn:7.3f} ms ({row['cudnn_tflops']:.0f})  ratio {row['ratio_to_cudnn_tflops']:.2f} "
                  f"err {err:.1e}")
            if best is None or t < best["ms"]:
                best = row
        if frames == 84 and best is not None:
            result["best_dense_config_84"] = best["config"]
            bq, bn, w, st = best["config"]
            sparse = []
            for density in (0.5, 0.25, 0.125):
                ranges, counts, real_d = segment_ranges(lk, 3 * TPF, bsa.n_query_blocks(Q, bq), density, 8, g)
                t = cuda_ms(lambda: bsa.block_sparse_attention(q, k, v, ranges, counts, block_q=bq, block_n=bn,
                                                               num_warps=w, num_stages=st))
                sparse.append({"target_density": density, "density": real_d, "ms": t, "cudnn_ms": t_cudnn,
                               "bound_ms": 1.4 * real_d * t_cudnn + 0.05 * t_cudnn})
                print(f"sparse d={real_d:.3f}: {t:.3f} ms vs bound {sparse[-1]['bound_ms']:.3f} ms")
            result["sparse_84"] = sparse
            bias = torch.randn(1, H, lk, device="cuda")
            ranges, counts = bsa.dense_ranges(1, H, Q, lk, bq, device="cuda")
            result["dense_84_with_bias_ms"] = cuda_ms(lambda: bsa.block_sparse_attention(
                q, k, v, ranges, counts, key_bias=bias, block_q=bq, block_n=bn, num_warps=w, num_stages=st))
            print(f"dense 84 frames with bias: {result['dense_84_with_bias_ms']:.3f} ms")
        del kv, k, v
    result["dense"] = dense_rows
    with open(os.path.join(args.out, "block_sparse_bench.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
