"""The self-attention prologue (q/k RMS norm + RoPE): fused Triton kernel against its eager torch twin.

Measured side by side in one run: the op at the Wan 1.3B chunk shape (4680 tokens x 1536, 12 heads, bf16) with
its error against the fp32 twin, and a whole chunk (4 denoising forwards + clean pass) of the 1.3B-shaped model
with attention removed (bench/testbed.NoAttention), once with each prologue.

    python bench/prologue_bench.py --out bench/results
    python bench/prologue_bench.py --smoke          # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pkg import fastar  # noqa: E402
from testbed import CHUNK, NoAttention, testbed  # noqa: E402
from timing import op_ms, wall_ms  # noqa: E402

import comfyui_fastar.fastar.models.wan as wan  # noqa: E402
from comfyui_fastar.kernels.qk_norm_rope import qk_norm_rope_auto, qk_norm_rope_torch  # noqa: E402


def chunk_ms(model, context, hw, reps, device):
    run = fastar.Rollout(model, context, frames=CHUNK, height=hw[0], width=hw[1], chunk_frames=CHUNK,
                         cache=fastar.CacheConfig("unbounded"))
    run.attention = NoAttention(run.cache)
    with torch.inference_mode():
        run.cache.begin_chunk(0, CHUNK)
        run.sample_chunk(0)
        return statistics.median(wall_ms(lambda: run.sample_chunk(0), reps, device))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args()
    device, size, hw = (torch.device("cpu"), "tiny", (64, 96)) if args.smoke else (torch.device("cuda"), "1.3B", (480, 832))
    model, context = testbed(size=size, device=str(device))
    heads, dim = model.num_heads, model.num_heads * model.head_dim
    tokens = CHUNK * (hw[0] // 16) * (hw[1] // 16)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, tokens, dim, device=device, generator=g).to(model.dtype)
    weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(model.dtype)
    freqs = wan.rope_frequencies(model.head_dim, (CHUNK, hw[0] // 16, hw[1] // 16), 81, device=device)
    ref = qk_norm_rope_torch(x.float(), weight.float(), freqs, heads)
    op = {}
    for name, fn in (("eager", qk_norm_rope_torch), ("fused", qk_norm_rope_auto)):
        out = fn(x, weight, freqs, heads)
        op[name] = {"ms": op_ms(lambda: fn(x, weight, freqs, heads), device),
                    "max_abs_err_vs_fp32": (out.float() - ref).abs().max().item()}
    forward = {}
    for name, fn in (("eager", qk_norm_rope_torch), ("fused", qk_norm_rope_auto)):
        wan.qk_norm_rope_auto = fn  # the model's prologue for this measurement
        forward[name] = chunk_ms(model, context, hw, args.reps, device)
    wan.qk_norm_rope_auto = qk_norm_rope_auto
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "shape": {"tokens": tokens, "channels": dim, "heads": heads, "dtype": str(model.dtype)},
              "op": op, "op_speedup": op["eager"]["ms"] / op["fused"]["ms"],
              "chunk_without_attention_ms": forward,
              "chunk_saving_ms": forward["eager"] - forward["fused"]}
    print(json.dumps(result, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prologue_bench" + ("_smoke" if args.smoke else "") + ".json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
