"""A per-key logit bias (TempCache's log m) on cuDNN attention: as an attention mask, or folded into
extra key channels (q gets ones, k gets the bias split into bf16 hi + lo parts) so the maskless fast
path runs. TempCache's budget shape: 4680 queries, 24 frames of 1560 keys, 12 heads x 128, bf16.

    python bench/bias_bench.py --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cuda_ms  # noqa: E402

Q, K, H, D = 4680, 24 * 1560, 12, 128


def folded(q, k, v, bias, extra, pad_v):
    """q, k, v [B, H, L, D]; bias [B, H, Lk] fp32."""
    scale = D ** -0.5
    b = bias * math.sqrt(D)
    hi = b.to(q.dtype)
    lo = torch.where(torch.isfinite(b), b - hi.float(), 0.0).to(q.dtype)  # -inf stays in hi alone
    qa = F.pad(q, (0, extra))
    qa[..., D:D + 2] = 1
    ka = F.pad(k, (0, extra))
    ka[..., D], ka[..., D + 1] = hi, lo
    va = F.pad(v, (0, extra)) if pad_v else v
    out = F.scaled_dot_product_attention(qa, ka, va, scale=scale)
    return out[..., :D]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, Q, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, H, K, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, H, K, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.log(torch.randint(1, 12, (1, H, K), device="cuda", generator=g).float())
    bias[..., : 2 * 1560] = float("-inf")  # empty slots
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias[:, :, None])
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "shape": [Q, K, H, D]}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        plain = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        mask = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)[:, :, None])  # noqa: E731
        res["no_bias_ms"] = cuda_ms(plain)
        res["mask_ms"] = cuda_ms(mask)
        res["mask_err"] = ((mask().float() - ref).norm() / ref.norm()).item()
        for extra in (8, 16):
            for pad_v in (False, True):
                name = f"fold_{D + extra}{'_padv' if pad_v else ''}"
                try:
                    out = folded(q, k, v, bias, extra, pad_v)
                    res[name + "_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                    res[name + "_ms"] = cuda_ms(lambda: folded(q, k, v, bias, extra, pad_v))
                except RuntimeError as exc:
                    res[name] = f"unsupported: {str(exc)[:100]}"
    for key, val in res.items():
        print(f"{key:24s} {val}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bias_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
