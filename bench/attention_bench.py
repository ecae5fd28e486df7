"""FAST-AR's two attention shapes per key against cuDNN dense, side by side in one process.

TempCache's biased read (sink 3 + the open chunk 3 unbiased, then F history frames with log m as a
per-key bias, the TempCache layout) and AnnSA's block plans over that history at densities d, at
F = 21 / 81 / 240 cached frames: 4680 queries (a 3-frame chunk), 12 heads x 128, bf16 (Wan 2.1 1.3B).
Paths: cuDNN dense without the bias (the rate to reach), cuDNN with the bias as a float mask, the
Triton kernel (``fastar.backend.Triton().biased``, ``block_sparse_attention``), FlashAttention-4
where it imports (``kernels/flash4.py``; ``pip install comfyui-fastar[hopper]``): dense, and with
the bias folded into the keys; its block sparsity over the history (cuDNN's softmax over the
unbiased keys joined to it). Cross-attention's shape (512 prompt tokens) for cuDNN against FA4. Each call is
replayed from a CUDA graph where it captures, the paths taking turns for 5 rounds; medians. Error:
‖out - ref‖ / ‖ref‖ against fp32 math on 256 sampled queries. Plans are random block picks (planning
is not timed here: ``bench/ann_bound.py`` times it).

    python bench/attention_bench.py --out bench/results
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, write_json  # noqa: E402,F401
from common.attention import D, FIXED, H, LQ, TPF, inputs, reference, rel, timed  # noqa: E402
from comfyui_fastar.fastar import sdpa  # noqa: E402
from comfyui_fastar.fastar.backend import Triton  # noqa: E402
from comfyui_fastar.kernels import flash4  # noqa: E402
from comfyui_fastar.kernels.block_sparse_attention import block_sparse_attention  # noqa: E402
from comfyui_fastar.kernels.plan import runs_to_ranges  # noqa: E402

KB = 128         # AnnSA's key block


def random_plan(frames: int, density: float, block_q: int, g):
    """Per (head, query block) a random ``density`` of the history's key blocks: (sel [1, H, nqb, nkb])."""
    nkb = -(-frames * TPF // KB)
    nqb = -(-LQ // block_q)
    score = torch.rand(1, H, nqb, nkb, device="cuda", generator=g)
    kth = max(1, round(density * nkb))
    return score >= score.topk(kth, dim=-1).values[..., -1:]


def plan_ranges(sel, frames):
    """The Triton kernel's plan over the whole key axis: runs of picked history blocks."""
    nkb = sel.shape[-1]
    starts = FIXED + torch.arange(nkb, device="cuda") * KB
    ends = (starts + KB).clamp(max=FIXED + frames * TPF)
    ranges, counts = runs_to_ranges(sel, starts.expand_as(sel), ends.expand_as(sel), 2 + nkb, sink=0,
                                    chunk_start=0, chunk_stop=0)
    return ranges[..., 2:, :].contiguous(), counts - 2


def plan_blocks(sel):
    """FA4's plan over the history: (counts, block indices), picked blocks first."""
    nkb = sel.shape[-1]
    idx = torch.where(sel, torch.arange(nkb, device="cuda"), nkb).sort(-1).values.int()
    return sel.sum(-1, dtype=torch.int32), idx.clamp(max=nkb - 1).contiguous()


def keep_mask(sel, frames, block_q, rows):
    """[H, rows, Lk] bool of the keys a plan reads for the sampled query rows (the fixed keys and the
    picked blocks)."""
    lk = FIXED + frames * TPF
    blk = torch.arange(lk, device="cuda")
    hist_block = ((blk - FIXED).clamp(min=0) // KB)
    qb = rows // block_q
    picked = sel[0][:, qb][..., hist_block]  # [H, LQ, Lk]
    return picked | (blk < FIXED)


def main():
    args = parser(__doc__).parse_args()
    p = args.__dict__
    frames_list = (21, 81, 240)
    densities = (0.25, 0.5, 0.9)
    has_fa4 = flash4.available(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    print(f"FA4 available: {has_fa4}")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randperm(LQ, generator=torch.Generator().manual_seed(1))[:256].cuda()
    result = {**header("cuda"), "fa4": has_fa4, "shape": {"queries": LQ, "heads": H, "head_dim": D, "fixed_keys": FIXED},
              "dense": [], "sparse": []}
    with torch.inference_mode():
        if has_fa4:
            qc = torch.randn(1, LQ, H, D, device="cuda", generator=g).bfloat16()
            kc, vc = (torch.randn(1, 512, H, D, device="cuda", generator=g).bfloat16() for _ in range(2))
            ms = timed({"cudnn": lambda: sdpa.attend_sdpa(qc, kc, vc), "fa4": lambda: flash4.attention(qc, kc, vc)[0]})
            result["cross"] = ms
            print(f"cross-attention (512 keys): cudnn {ms['cudnn']:.3f} ms, fa4 {ms['fa4']:.3f} ms")
        for frames in frames_list:
            q, k, v, bias = inputs(frames, g)
            lk = k.shape[1]
            window = (FIXED, lk)
            fns = {
                "cudnn": lambda: sdpa.attend_sdpa(q, k, v),
                "cudnn_mask": lambda: sdpa.attend_sdpa(q, k, v, key_bias=bias),
                "triton": lambda: Triton().biased(q, k, v, bias, window),
            }
            hist_bias = bias[:, :, FIXED:].contiguous()
            if has_fa4:
                fns["fa4"] = lambda: flash4.attention(q, k, v)[0]
                fns["fa4_bias"] = lambda: flash4.attention(q, k, v, key_bias=bias, bias_window=window)[0]
            ref = reference(q, k, v, bias, rows)
            ref0 = reference(q, k, v, torch.zeros_like(bias), rows)
            row = {"frames": frames, "keys": lk, "ms": {}, "err": {}}
            for name, fn in fns.items():
                try:
                    out = fn()
                    row["err"][name] = rel(out, ref0 if name in ("cudnn", "fa4") else ref, rows)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} failed at {frames} frames: {type(e).__name__}: {str(e)[:300]}")
            fns = {n: f for n, f in fns.items() if n in row["err"]}
            row["ms"] = timed(fns)
            flops = 4 * LQ * lk * D * H
            row["tflops"] = {n: flops / ms / 1e9 for n, ms in row["ms"].items()}
            base = row["ms"]["cudnn"]
            print(f"{frames:4d} frames ({lk} keys): " + "  ".join(
                f"{n} {ms:.3f} ms ({ms / base:.2f}x, err {row['err'][n]:.4f})" for n, ms in row["ms"].items()))
            result["dense"].append(row)

            for d in densities:
                for bq in (128,):
                    sel = random_plan(frames, d, bq, g)
                    density = (FIXED + sel.float().mean().item() * frames * TPF) / lk
                    ranges, counts = plan_ranges(sel, frames)
                    prior = sdpa.attend_lse(q, k[:, :FIXED], v[:, :FIXED])
                    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    sfns = {"cudnn": lambda: sdpa.attend_sdpa(q, k, v)}

                    def tri():
                        pr = sdpa.attend_lse(q, k[:, :FIXED], v[:, :FIXED])
                        return block_sparse_attention(qt, kt, vt, ranges, counts, key_bias=bias, block_q=bq,
                                                      prior=pr, bias_window=window).transpose(1, 2)
                    sfns["triton"] = tri
                    if has_fa4:
                        blocks = plan_blocks(sel)

                        def fa4s():
                            o1, l1 = sdpa.attend_lse(q, k[:, :FIXED], v[:, :FIXED])
                            o2, l2 = flash4.attention(q, k[:, FIXED:], v[:, FIXED:], key_bias=hist_bias,
                                                      blocks=blocks, block_size=(bq, KB))
                            return flash4.join(o1.transpose(1, 2), l1, o2, l2)
                        sfns["fa4"] = fa4s

                    keep = keep_mask(sel, frames, bq, rows)
                    sref = reference(q, k, v, bias, rows, keep)
                    srow = {"frames": frames, "block_q": bq, "density": density, "ms": {}, "err": {}}
                    for name, fn in sfns.items():
                        if name == "cudnn":
                            continue
                        try:
                            srow["err"][name] = rel(fn(), sref, rows)
                        except Exception as e:  # noqa: BLE001
                            print(f"  sparse {name} failed: {type(e).__name__}: {str(e)[:300]}")
                    sfns = {n: f for n, f in sfns.items() if n == "cudnn" or n in srow["err"]}
                    srow["ms"] = timed(sfns, rounds=3)
                    srow["vs_d_cudnn"] = {n: ms / (density * srow["ms"]["cudnn"]) for n, ms in srow["ms"].items()}
                    print(f"  d={density:.3f} bq={bq}: " + "  ".join(
                        f"{n} {ms:.3f} ms ({srow['vs_d_cudnn'][n]:.2f}x d*cudnn, err {srow['err'].get(n, 0):.4f})"
                        for n, ms in srow["ms"].items()))
                    result["sparse"].append(srow)
                    del prior
            del q, k, v, bias
            torch.cuda.empty_cache()
    print("wrote", write_json(p["out"], "attention_bench.json", result))


if __name__ == "__main__":
    main()
