"""8-bit self-attention (int8 q.k, e4m3 or bf16 P.V, ``fastar.sdpa.attend8``) against the bf16 paths, at the
chunk's shapes.

Wan 2.1 1.3B (and, with ``--heads 40``, the 14B's head count): 4680 queries (a 3-frame chunk), heads x 128,
keys of F frames of 1560 tokens: 6 (sink 3 + the open chunk), 18 (the sink 3 + window 12 cache), 24 (TempCache
21 + the chunk), 84. For each F, GPU milliseconds (each call replayed from a CUDA graph, calls taking turns over
--rounds rounds, medians; ``common.side_by_side_ms``):

  dense      cuDNN bf16 (what the window cache runs), the bf16 kernel, and attend8 int8 / int8+fp8, the
             quantization included, and the kernel alone on inputs quantized beforehand, over a grid of launches;
  biased     TempCache's key bias on the history: the bf16 path (``attend_biased``: cuDNN over the sink and the
             chunk, the kernel over the history) against attend8;
  sparse     a plan reading half the history (random 128-key segments, the sink and the chunk whole), the bf16
             kernel with its cuDNN prior as AnnSA runs it against attend8 on the same plan;

and each path's error against fp32 attention on inputs whose queries match a few keys sharply (keys drawn from
the queries plus noise, scaled so the largest weight of a query averages ~0.4: the sensitized testbed's regime),
relative L2 of the output. Writes attention8_bench.json.

    python bench/attention8_bench.py --out bench/results     # ~3 minutes on an H200
"""
from __future__ import annotations

import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, side_by_side_ms, write_json  # noqa: E402,F401  (fastar: the checkout, imported)
from comfyui_fastar.fastar import sdpa  # noqa: E402
from comfyui_fastar.kernels.block_sparse_attention import block_sparse_attention  # noqa: E402
from comfyui_fastar.kernels.plan import dense_ranges  # noqa: E402
from comfyui_fastar.kernels.quantize8 import quantize8  # noqa: E402

TPF, D = 1560, 128
LAUNCHES = ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2))


def inputs(frames: int, heads: int, gain: float, g):
    """q [1, 4680, H, D] and k / v [1, frames * 1560, H, D], bf16: each key a noisy copy of a random query."""
    n, lk = 3 * TPF, frames * TPF
    q = torch.randn(1, n, heads, D, device="cuda", generator=g)
    pick = torch.randint(0, n, (lk,), device="cuda", generator=g)
    k = 0.7 * q[:, pick] + 0.3 * torch.randn(1, lk, heads, D, device="cuda", generator=g)
    v = torch.randn(1, lk, heads, D, device="cuda", generator=g)
    return (q * gain).bfloat16(), (k * gain).bfloat16(), v.bfloat16()


def reference(q, k, v, bias=None, plan_mask=None):
    """fp32 attention, one head at a time (a [4680, Lk] logit matrix per head)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[2]):
        logits = q[0, :, h].float() @ k[0, :, h].float().T / math.sqrt(D)
        if bias is not None:
            logits = logits + bias[0, h]
        if plan_mask is not None:
            logits = logits.masked_fill(~plan_mask[h], float("-inf"))
        out[0, :, h] = logits.softmax(-1) @ v[0, :, h].float()
    return out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def half_history_plan(lk: int, fixed: int, heads: int, block_q: int, g):
    """Per query block: the first ``fixed`` keys (sink and chunk at the front, as TempCache lays them out)
    plus half of the rest in random 128-key segments; (ranges, counts, mask [H, 4680, Lk])."""
    n, seg = 3 * TPF, 128
    nqb, slots = -(-n // block_q), (lk - fixed) // seg
    picks = slots // 2
    chosen = torch.rand(heads, nqb, slots, device="cuda", generator=g).argsort(-1)[..., :picks].sort(-1).values
    ranges = torch.zeros(1, heads, nqb, picks + 1, 2, dtype=torch.int32, device="cuda")
    ranges[..., 0, 1] = fixed
    ranges[0, :, :, 1:, 0] = (chosen * seg + fixed).int()
    ranges[0, :, :, 1:, 1] = (chosen * seg + fixed + seg).int()
    sel = torch.zeros(heads, nqb, slots, dtype=torch.bool, device="cuda").scatter_(-1, chosen, True)
    keys = torch.zeros(heads, nqb, lk, dtype=torch.bool, device="cuda")
    keys[..., :fixed] = True
    keys[..., fixed:fixed + slots * seg] = sel.repeat_interleave(seg, -1)
    mask = keys.repeat_interleave(block_q, 1)[:, :n]
    counts = torch.full((1, heads, nqb), picks + 1, dtype=torch.int32, device="cuda")
    return ranges, counts, mask


def main():
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--frames", default="6,18,24,84")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gain", type=float, default=1.9, help="q and k scale: the largest weight of a query ~0.4")
    args = ap.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {**header(device), "heads": args.heads, "queries": 3 * TPF, "head_dim": D, "rounds": args.rounds,
              "launches": [list(x) for x in LAUNCHES], "frames": {}}
    H = args.heads
    for frames in (int(f) for f in args.frames.split(",")):
        q, k, v = inputs(frames, H, args.gain, g)
        lk = k.shape[1]
        ref = reference(q, k, v)
        p_max = statistics.mean(
            (q[0, :256, h].float() @ k[0, :, h].float().T / math.sqrt(D)).softmax(-1).amax(-1).mean().item()
            for h in range(H))
        q8, qs = quantize8(q)
        k8, ks = quantize8(k)
        v8, vs = quantize8(v, "channel")
        row = {"keys": lk, "mean_max_weight": p_max, "ms": {}, "error_vs_fp32": {}}
        calls = {
            "cudnn bf16": lambda: sdpa.attend(q, k, v),
            "kernel bf16": lambda: sdpa.attend_biased(q, k, v, torch.zeros(1, H, lk, device="cuda"), (0, lk)),
            "attend8 int8": lambda: sdpa.attend8(q, k, v),
            "attend8 int8+fp8": lambda: sdpa.attend8(q, k, v, fp8_values=True),
            "quantize q,k": lambda: (quantize8(q), quantize8(k)),
            "quantize v": lambda: quantize8(v, "channel"),
        }
        for bq, bn, warps, stages in LAUNCHES:
            plan = dense_ranges(1, H, 3 * TPF, lk, bq, device="cuda")
            for vals, vscale, tag in ((v, None, "int8"), (v8, vs, "int8+fp8")):
                calls[f"kernel {tag} {bq}/{bn}/{warps}/{stages}"] = (
                    lambda plan=plan, vals=vals, vscale=vscale, bq=bq, bn=bn, warps=warps, stages=stages:
                    block_sparse_attention(q8.transpose(1, 2), k8.transpose(1, 2), vals.transpose(1, 2), *plan,
                                           block_q=bq, scales=(qs, ks, vscale), block_n=bn, num_warps=warps,
                                           num_stages=stages))
        # TempCache's bias on the history (the keys after the sink and the open chunk)
        fixed = min(6 * TPF, lk)
        bias = torch.zeros(1, H, lk, device="cuda")
        bias[..., fixed:] = torch.log(torch.randint(1, 4, (1, H, lk - fixed), device="cuda", generator=g).float())
        calls["biased bf16 (cuDNN prior + kernel)"] = lambda: sdpa.attend_biased(q, k, v, bias, (fixed, lk))
        calls["biased attend8 int8"] = lambda: sdpa.attend8(q, k, v, key_bias=bias, bias_window=(fixed, lk))
        calls["biased attend8 int8+fp8"] = lambda: sdpa.attend8(q, k, v, key_bias=bias, bias_window=(fixed, lk),
                                                                fp8_values=True)
        sparse = None
        if lk > fixed + 2 * 128 and frames <= 24:
            ranges, counts, mask = half_history_plan(lk, fixed, H, 64, g)
            sparse = (ranges, counts)

            def bf16_sparse():  # as AnnSA runs it: cuDNN over the fixed keys as the prior, the kernel on the rest
                prior = sdpa.attend_lse(q, k[:, :fixed], v[:, :fixed])
                return block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              ranges[..., 1:, :], counts - 1, prior=prior).transpose(1, 2)
            calls["sparse bf16 (cuDNN prior + kernel)"] = bf16_sparse
            calls["sparse attend8 int8"] = lambda: sdpa.attend8(q, k, v, plan=sparse, block_q=64)
            calls["sparse attend8 int8+fp8"] = lambda: sdpa.attend8(q, k, v, plan=sparse, block_q=64,
                                                                    fp8_values=True)
        times = side_by_side_ms(calls, device, rounds=args.rounds)
        row["ms"] = {name: statistics.median(t) for name, t in times.items()}
        row["ms_rounds"] = times
        outs = {"cudnn bf16": sdpa.attend(q, k, v), "attend8 int8": sdpa.attend8(q, k, v),
                "attend8 int8+fp8": sdpa.attend8(q, k, v, fp8_values=True)}
        row["error_vs_fp32"] = {name: rel(o, ref) for name, o in outs.items()}
        ref_b = reference(q, k, v, bias)
        row["error_vs_fp32"].update({
            "biased bf16": rel(sdpa.attend_biased(q, k, v, bias, (fixed, lk)), ref_b),
            "biased attend8 int8": rel(sdpa.attend8(q, k, v, key_bias=bias, bias_window=(fixed, lk)), ref_b),
            "biased attend8 int8+fp8": rel(sdpa.attend8(q, k, v, key_bias=bias, bias_window=(fixed, lk),
                                                        fp8_values=True), ref_b)})
        if sparse is not None:
            ref_s = reference(q, k, v, plan_mask=mask)
            row["error_vs_fp32"].update({
                "sparse bf16": rel(bf16_sparse(), ref_s),
                "sparse attend8 int8": rel(sdpa.attend8(q, k, v, plan=sparse, block_q=64), ref_s),
                "sparse attend8 int8+fp8": rel(sdpa.attend8(q, k, v, plan=sparse, block_q=64, fp8_values=True),
                                               ref_s)})
        result["frames"][str(frames)] = row
        base = row["ms"]["cudnn bf16"]
        print(f"\n{frames} frames ({lk} keys, {H} heads, mean max weight {p_max:.3f}):", flush=True)
        for name, ms in row["ms"].items():
            print(f"  {name:42s} {ms:8.3f} ms  x{base / ms:5.2f} of cuDNN", flush=True)
        print("  error vs fp32: " + "  ".join(f"{n} {e:.4f}" for n, e in row["error_vs_fp32"].items()), flush=True)
    write_json(args.out, f"attention8_bench{'' if H == 12 else f'_{H}h'}.json", result)


if __name__ == "__main__":
    main()
