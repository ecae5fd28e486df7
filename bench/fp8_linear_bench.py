"""The Wan blocks' linear layers on fp8 tensor cores (kernels/fp8_linear.py) against the bf16 layers
the model runs today, on the GPU.

At Wan 2.1 1.3B's 3-frame chunk (4680 tokens, dim 1536, FFN 8960), per kind of layer: the median
GPU time of the bf16 layer as the model runs it (cuBLAS; the FFN's up projection with its tanh GELU
in the GEMM's epilogue) and of the fp8 one, the row quantization included (q/k/v share one; the
GELU moves into the down projection's), side by side from CUDA graphs (CUDA events, 15 calls a
round, 5 rounds taking turns), with the quantization and the scaled matmul alone beside them and
Hopper's fast fp8 accumulation and, for weights stored in e4m3 as ComfyUI loads fp8 checkpoints, the bf16
layer over the weight cast on every call (what the fused engine did before) as variants; the layers' errors against the fp32 layer. Then one
whole block forward of the chunk (dense self-attention over its own keys, cross-attention over 512
text tokens) in bf16 and through ``fp8_linears``, and the block output's error against bf16 and
fp32. About a minute on an H200.

    python bench/fp8_linear_bench.py --out bench/results
    python bench/fp8_linear_bench.py --size 14B --out bench/results     # the 14B's layers: fp8_linear_bench_14B.json
    python bench/fp8_linear_bench.py --smoke --out /tmp/fp8      # CPU, tiny shapes: checks the script
"""
from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, side_by_side_ms, write_json  # noqa: E402
from comfyui_fastar.kernels import use_kernel  # noqa: E402
from comfyui_fastar.kernels.fp8_linear import (  # noqa: E402
    fp8_linear_auto,
    fp8_matmul_auto,
    quantize_rows_auto,
    quantize_weight,
    scaled_mm_runs,
)

FORWARDS_PER_CHUNK = 5  # 4 denoising steps + the clean pass


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ffn_up_bf16(x, w, b):
    """The FFN's first GEMM as WanAttentionBlock.feed_forward runs it: tanh GELU in cuBLASLt's epilogue."""
    if x.is_cuda:
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def layer_cases(m, dim, ffn, device, g):
    """Per kind of layer, over seeded bf16 operands: the bf16 call, the fp8 call (and its quantization
    and scaled matmul alone, and the fast-accumulation variant), the fp32 reference and the flops."""
    def operands(k, n):
        x = torch.randn(m, k, device=device, generator=g).bfloat16()
        w = (k ** -0.5 * torch.randn(n, k, device=device, generator=g)).bfloat16()
        b = (0.02 * torch.randn(n, device=device, generator=g)).bfloat16()
        return x, w, b, *quantize_weight(w)

    cases = []
    x, w, b, w8, ws = operands(dim, dim)
    rows = quantize_rows_auto(x)
    cases.append(dict(
        layer="qkvo", shape=[m, dim, dim], flops=2 * m * dim * dim,
        bf16=lambda: F.linear(x, w, b), fp8=lambda: fp8_linear_auto(x, w8, ws, b),
        cast=lambda: F.linear(x, w8.to(x.dtype), b),
        fp8_fast=lambda: fp8_linear_auto(x, w8, ws, b, use_fast_accum=True),
        quant=lambda: quantize_rows_auto(x), mm=lambda: fp8_matmul_auto(*rows, w8, ws, b, out_dtype=x.dtype),
        ref=lambda: F.linear(x.float(), w.float(), b.float())))
    qkv = [operands(dim, dim)[1:] for _ in range(3)]
    cases.append(dict(
        layer="qkv_shared", shape=[m, dim, 3 * dim], flops=3 * 2 * m * dim * dim,
        bf16=lambda: [F.linear(x, w_, b_) for w_, b_, _, _ in qkv],
        fp8=lambda: [fp8_matmul_auto(*r, w8_, ws_, b_, out_dtype=x.dtype)
                     for r in [quantize_rows_auto(x)] for _, b_, w8_, ws_ in qkv],
        ref=lambda: [F.linear(x.float(), w_.float(), b_.float()) for w_, b_, _, _ in qkv]))
    xu, wu, bu, wu8, wus = operands(dim, ffn)
    ru = quantize_rows_auto(xu)
    cases.append(dict(
        layer="ffn_up", shape=[m, dim, ffn], flops=2 * m * dim * ffn,
        bf16=lambda: ffn_up_bf16(xu, wu, bu), fp8=lambda: fp8_linear_auto(xu, wu8, wus, bu),
        cast=lambda: ffn_up_bf16(xu, wu8.to(xu.dtype), bu),
        fp8_fast=lambda: fp8_linear_auto(xu, wu8, wus, bu, use_fast_accum=True),
        quant=lambda: quantize_rows_auto(xu), mm=lambda: fp8_matmul_auto(*ru, wu8, wus, bu, out_dtype=xu.dtype),
        ref=lambda: F.linear(xu.float(), wu.float(), bu.float()), bf16_value=lambda: F.linear(xu, wu, bu),
        note="fp8 gives the pre-activation (its GELU is in ffn_down's quantization): the errors are the "
             "pre-activation's"))
    pre = (torch.randn(m, ffn, device=device, generator=g)).bfloat16()
    hidden = F.gelu(pre, approximate="tanh")
    _, wd, bd, wd8, wds = operands(ffn, dim)
    rd = quantize_rows_auto(pre, gelu=True)
    cases.append(dict(
        layer="ffn_down", shape=[m, ffn, dim], flops=2 * m * ffn * dim,
        bf16=lambda: F.linear(hidden, wd, bd), fp8=lambda: fp8_linear_auto(pre, wd8, wds, bd, gelu_input=True),
        cast=lambda: F.linear(hidden, wd8.to(hidden.dtype), bd),
        fp8_fast=lambda: fp8_linear_auto(pre, wd8, wds, bd, gelu_input=True, use_fast_accum=True),
        quant=lambda: quantize_rows_auto(pre, gelu=True),
        mm=lambda: fp8_matmul_auto(*rd, wd8, wds, bd, out_dtype=pre.dtype),
        ref=lambda: F.linear(F.gelu(pre.float(), approximate="tanh"), wd.float(), bd.float()),
        note="bf16 reads the GELU'd hidden activation; fp8 quantizes the pre-activation through the GELU"))
    cases.append(dict(
        layer="ffn", shape=[m, dim, ffn, dim], flops=4 * m * dim * ffn,
        bf16=lambda: F.linear(ffn_up_bf16(xu, wu, bu), wd, bd),
        fp8=lambda: fp8_linear_auto(fp8_linear_auto(xu, wu8, wus, bu), wd8, wds, bd, gelu_input=True),
        ref=lambda: F.linear(F.gelu(F.linear(xu.float(), wu.float(), bu.float()), approximate="tanh"), wd.float(),
                             bd.float())))
    return cases


def flat(y):
    return torch.cat([t.flatten() for t in y]) if isinstance(y, list) else y


def time_layers(cases, device, rounds):
    rows = []
    for case in cases:
        fns = {k: case[k] for k in ("bf16", "fp8", "fp8_fast", "quant", "mm", "cast") if k in case}
        times = side_by_side_ms(fns, device, rounds=rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        # ffn_up's fp8 output is the pre-activation: its errors are those of the GEMM before the GELU
        ref, bf16, fp8 = (flat(case.get(k, case["bf16"] if k == "bf16_value" else None)())
                          for k in ("ref", "bf16_value", "fp8"))
        row = {"layer": case["layer"], "shape": case["shape"], "bf16_ms": med["bf16"], "fp8_ms": med["fp8"],
               "speedup": med["bf16"] / med["fp8"], "bf16_ms_rounds": times["bf16"], "fp8_ms_rounds": times["fp8"],
               "bf16_tflops": case["flops"] / med["bf16"] / 1e9, "fp8_tflops": case["flops"] / med["fp8"] / 1e9}
        for k in ("fp8_fast", "quant", "mm", "cast"):
            if k in med:
                row[f"{k}_ms"] = med[k]
        if "mm" in med:
            row["mm_tflops"] = case["flops"] / med["mm"] / 1e9
        row["bf16_rel_err_vs_fp32"] = rel(bf16, ref)
        row["fp8_rel_err_vs_fp32"] = rel(fp8, ref)
        row["fp8_rel_err_vs_bf16"] = rel(fp8, bf16)
        if "note" in case:
            row["note"] = case["note"]
        rows.append(row)
        extra = "".join(f"  {k} {med[k]:.3f}" for k in ("quant", "mm", "fp8_fast", "cast") if k in med)
        print(f"{case['layer']:10s} {str(case['shape']):22s} bf16 {med['bf16']:7.3f} ms  fp8 {med['fp8']:7.3f} ms  "
              f"x{row['speedup']:.2f}{extra}  err vs fp32: bf16 {row['bf16_rel_err_vs_fp32']:.1e} "
              f"fp8 {row['fp8_rel_err_vs_fp32']:.1e}")
    return rows


@torch.no_grad()
def time_block(size, grid, text_tokens, device, rounds):
    """One block's forward of a chunk: bf16, fp8_linears of it, and the fp32 block for the errors."""
    models = fastar.models
    cfg = dataclasses.replace(models.WAN_CONFIGS[size], num_layers=1)
    wan32 = models.build_model(cfg, device=device, dtype=torch.float32, seed=0)
    for name, p in wan32.named_parameters():  # the biases random too, so that the fp8 layers' bias path counts
        if name.startswith("blocks.") and name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(len(name)))
    wan16 = copy.deepcopy(wan32).to(torch.bfloat16)
    wan8 = models.fp8_linears(wan16)
    g = torch.Generator(device=device).manual_seed(1)
    f, h, w = grid
    x = torch.randn(1, f, h * w, cfg.dim, device=device, generator=g)
    e = 0.1 * torch.randn(1, 1, 6, cfg.dim, device=device, generator=g)
    text = torch.randn(1, text_tokens, cfg.dim, device=device, generator=g)
    freqs = models.wan.rope_frequencies(cfg.head_dim, grid, 0, device=device)
    attention = fastar.FastARAttention()

    def forward(model, dtype):
        block = model.blocks[0]
        args = (x.to(dtype), e.to(dtype), freqs, block.cross_attn.text_kv(text.to(dtype)), attention, 0)
        call = lambda: block(*args)  # noqa: E731

        def output():
            out, (y, gate) = call()
            return out.float() + y.float() * gate.float().unsqueeze(2)
        return call, output

    (bf16, bf16_out), (fp8, fp8_out), (_, fp32_out) = (forward(wan16, torch.bfloat16), forward(wan8, torch.bfloat16),
                                                       forward(wan32, torch.float32))
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = fp32_out()
    torch.backends.cuda.matmul.allow_tf32 = allow
    y16, y8 = bf16_out(), fp8_out()
    times = side_by_side_ms({"bf16": bf16, "fp8": fp8}, device, rounds=rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"size": size, "tokens": f * h * w, "grid": list(grid), "text_tokens": text_tokens,
              "bf16_ms": med["bf16"], "fp8_ms": med["fp8"], "speedup": med["bf16"] / med["fp8"],
              "bf16_ms_rounds": times["bf16"], "fp8_ms_rounds": times["fp8"],
              # all blocks of the model, every forward of a chunk (the clean pass stops inside the last block)
              "chunk_ms_saved_estimate": (med["bf16"] - med["fp8"]) * models.WAN_CONFIGS[size].num_layers
              * FORWARDS_PER_CHUNK,
              "fp8_rel_err_vs_bf16": rel(y8, y16), "fp8_rel_err_vs_fp32": rel(y8, ref),
              "bf16_rel_err_vs_fp32": rel(y16, ref)}
    print(f"block {size} ({f * h * w} tokens): bf16 {med['bf16']:.3f} ms  fp8 {med['fp8']:.3f} ms  "
          f"x{result['speedup']:.2f}  (x {models.WAN_CONFIGS[size].num_layers} blocks x {FORWARDS_PER_CHUNK} "
          f"forwards: {result['chunk_ms_saved_estimate']:.1f} ms a chunk)  output err: fp8 vs bf16 "
          f"{result['fp8_rel_err_vs_bf16']:.1e}, vs fp32 {result['fp8_rel_err_vs_fp32']:.1e} "
          f"(bf16 vs fp32 {result['bf16_rel_err_vs_fp32']:.1e})")
    return result


def main(argv=None):
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the side-by-side timing (default 5)")
    ap.add_argument("--size", choices=("1.3B", "14B"), default="1.3B", help="the model's layer shapes")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.smoke:
        device, size, grid, text_tokens = torch.device("cpu"), "tiny", (3, 4, 6), 7
    else:
        device, size, grid, text_tokens = torch.device("cuda"), args.size, (3, 30, 52), 512
    cfg = fastar.models.WAN_CONFIGS[size]
    m = grid[0] * grid[1] * grid[2]
    probe = torch.empty(1, 1, device=device, dtype=torch.bfloat16)
    result = {**header(device), "smoke": bool(args.smoke), "size": size, "tokens": m, "dim": cfg.dim,
              "ffn_dim": cfg.ffn_dim, "rounds": args.rounds,
              "fp8_path": {"scaled_mm": scaled_mm_runs(probe.to(torch.float8_e4m3fn), cfg.dim, cfg.ffn_dim,
                                                       torch.bfloat16),
                           "quantize_kernel": use_kernel(probe, interpreted=False)}}
    if device.type == "cuda":
        result["gpu_capability"] = list(torch.cuda.get_device_capability(device))
    print(f"{result['device']}: fp8 path {result['fp8_path']}")
    g = torch.Generator(device=device).manual_seed(0)
    result["layers"] = time_layers(layer_cases(m, cfg.dim, cfg.ffn_dim, device, g), device, args.rounds)
    result["block"] = time_block(size, grid, text_tokens, device, args.rounds)
    result["runtime_s"] = time.time() - t0
    name = "fp8_linear_bench.json" if size in ("1.3B", "tiny") else f"fp8_linear_bench_{size}.json"
    print(f"wrote {write_json(args.out, name, result)} ({result['runtime_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
