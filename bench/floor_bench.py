"""The work around the GEMMs of a forward: the fused kernels against the eager ops they replace.

Three fusions, measured side by side in one run (GPU time, each call replayed from a CUDA graph,
calls taking turns over five rounds; bench/timing.side_by_side_ms):
  prologue  q/k RMS norm + RoPE as one kernel (kernels/qk_norm_rope.py) vs its eager twin
  adaln     residual + LayerNorm + modulation as one kernel (kernels/adaln.py) vs the block's
            former eager ops (addcmul, LayerNorm, addcmul)
  gelu      the FFN's tanh GELU in the first GEMM's epilogue (cuBLASLt) vs GEMM + GELU kernel
each as one op at the Wan 1.3B chunk shape (4680 tokens x 1536, bf16), and a whole chunk (4 denoising
forwards + clean pass) of the 1.3B-shaped model with attention removed (bench/testbed.NoAttention):
all fused, all eager, and each fusion alone switched back to eager.

    python bench/floor_bench.py --out bench/results
    python bench/floor_bench.py --smoke          # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pkg import fastar  # noqa: E402
from testbed import CHUNK, NoAttention, testbed  # noqa: E402
from timing import side_by_side_ms  # noqa: E402

import comfyui_fastar.fastar.models.wan as wan  # noqa: E402
from comfyui_fastar.kernels.adaln import adaln_auto, adaln_torch  # noqa: E402
from comfyui_fastar.kernels.qk_norm_rope import qk_norm_rope_auto, qk_norm_rope_torch  # noqa: E402

FUSIONS = ("prologue", "adaln", "gelu")


def adaln_eager(x, scale, shift, *, y=None, gate=None, one_plus=True, eps=1e-6):
    """The Wan block's eager ops, as it ran them before the fused kernel."""
    r = x if y is None else (torch.addcmul(x, y, gate.unsqueeze(2)) if gate is not None else x + y)
    if not one_plus:
        return r, F.layer_norm(r, (r.shape[-1],), scale, shift, eps)
    return r, torch.addcmul(shift.unsqueeze(2), F.layer_norm(r, (r.shape[-1],), eps=eps), 1 + scale.unsqueeze(2))


def ffn_eager(block, h):
    up, act, down = block.ffn
    return down(act(up(h)))


FUSED_FFN = wan.WanAttentionBlock.feed_forward


@contextlib.contextmanager
def eager(names):
    """Switch the named fusions back to their eager ops for the duration."""
    wan.qk_norm_rope_auto = qk_norm_rope_torch if "prologue" in names else qk_norm_rope_auto
    wan.adaln_auto = adaln_eager if "adaln" in names else adaln_auto
    wan.WanAttentionBlock.feed_forward = ffn_eager if "gelu" in names else FUSED_FFN
    try:
        yield
    finally:
        wan.qk_norm_rope_auto, wan.adaln_auto, wan.WanAttentionBlock.feed_forward = \
            qk_norm_rope_auto, adaln_auto, FUSED_FFN


def in_mode(fn, names):
    def call():
        with eager(names):
            return fn()
    return call


def ratio(times, a, b):
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args()
    device, size, hw = (torch.device("cpu"), "tiny", (64, 96)) if args.smoke else (torch.device("cuda"), "1.3B", (480, 832))
    model, context = testbed(size=size, device=str(device))
    heads, dim, dtype = model.num_heads, model.num_heads * model.head_dim, model.dtype
    grid = (CHUNK, hw[0] // 16, hw[1] // 16)
    tokens = grid[0] * grid[1] * grid[2]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, CHUNK, tokens // CHUNK, dim, device=device, generator=g).to(dtype)
    y = torch.randn_like(x)
    e = (0.1 * torch.randn(1, CHUNK, 6, dim, device=device, generator=g)).to(dtype).unbind(2)
    weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)
    freqs = wan.rope_frequencies(model.head_dim, grid, 81, device=device)
    block = model.blocks[0]
    flat = x.view(1, tokens, dim)

    # errors against the fp32 twins (the fused kernel rounds once; the eager ops at every step)
    ref = adaln_torch(x.float(), e[4].float(), e[3].float(), y=y.float(), gate=e[2].float())[1]
    err = {name: (fn(x, e[4], e[3], y=y, gate=e[2])[1].float() - ref).abs().max().item()
           for name, fn in (("adaln_eager", adaln_eager), ("adaln_fused", adaln_auto))}
    ref = qk_norm_rope_torch(flat.float(), weight.float(), freqs, heads)
    err.update({name: (fn(flat, weight, freqs, heads).float() - ref).abs().max().item()
                for name, fn in (("prologue_eager", qk_norm_rope_torch), ("prologue_fused", qk_norm_rope_auto))})
    with torch.no_grad():
        ref = ffn_eager(block, x).float()
        err["gelu_epilogue_vs_eager"] = (FUSED_FFN(block, x).float() - ref).abs().max().item()

    with torch.inference_mode():
        op = side_by_side_ms({
            "prologue_eager": lambda: qk_norm_rope_torch(flat, weight, freqs, heads),
            "prologue_fused": lambda: qk_norm_rope_auto(flat, weight, freqs, heads),
            "adaln_eager": lambda: adaln_eager(x, e[4], e[3], y=y, gate=e[2]),
            "adaln_fused": lambda: adaln_auto(x, e[4], e[3], y=y, gate=e[2]),
            "ffn_eager": lambda: ffn_eager(block, x),
            "ffn_gelu_epilogue": lambda: FUSED_FFN(block, x),
        }, device, args.rounds)

        run = fastar.Rollout(model, context, frames=CHUNK, height=hw[0], width=hw[1], chunk_frames=CHUNK,
                             cache=fastar.CacheConfig("unbounded"), cuda_graphs=False)
        run.attention = NoAttention(run.cache)
        run.cache.begin_chunk(0, CHUNK)
        run.attention.num_steps = len(run.sigmas)
        noise = [torch.randn(run.chunk_shape, device=device, generator=g) for _ in run.sigmas]
        modes = {"fused": (), "eager": FUSIONS, **{f"eager {f}": (f,) for f in FUSIONS}}
        # the chunk's denoising steps and clean pass, as the rollout captures them
        chunk = side_by_side_ms({name: in_mode(lambda: run._denoise(noise, 0), names) for name, names in modes.items()},
                                device, args.rounds)
    median = lambda ts: {k: statistics.median(v) for k, v in ts.items()}  # noqa: E731
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "shape": {"tokens": tokens, "channels": dim, "heads": heads, "ffn": model.blocks[0].ffn[0].out_features,
                        "dtype": str(dtype)},
              "timing": "GPU ms, CUDA-graph replays, median of %d alternating rounds" % args.rounds,
              "max_abs_err_vs_fp32": err,
              "op_ms": median(op), "op_rounds_ms": op,
              "op_speedup": {f: ratio(op, a, b) for f, a, b in (("prologue", "prologue_eager", "prologue_fused"),
                                                                ("adaln", "adaln_eager", "adaln_fused"),
                                                                ("gelu", "ffn_eager", "ffn_gelu_epilogue"))},
              "chunk_without_attention_ms": median(chunk), "chunk_rounds_ms": chunk,
              "chunk_eager_over_fused": ratio(chunk, "eager", "fused"),
              "chunk_saving_ms": {f: statistics.median(a - b for a, b in zip(chunk[f"eager {f}"], chunk["fused"]))
                                  for f in FUSIONS}}
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("rounds_ms")}, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "floor_bench" + ("_smoke" if args.smoke else "") + ".json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
