"""How sensitive is a testbed? The sweep that chose bench/testbed.py's SENSITIVE gains.

For each setting (the plain init, or sensitize's gains plus an optional cross-attention output scale), the
1.3B-shaped model continues the real clip after 48 cached frames for 2 chunks, and the generated latents of
several caches are scored (PSNR, dB) against dense bf16: dense fp32 (the noise floor), own chunk only (the
control that drops the history), sink 3 + window 6, TempCache and AnnSA at their defaults. Attention
concentration at layer 15 (next chunk's queries at sigma 0.625 over all keys): the mass on the history and
the mass held by the top 1 / 5 / 10% of keys. A sensitive testbed has the control far under the noise floor.

    python bench/testbed_probe.py --settings plain,1.5:0.5:5:1 --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testbed import CHUNK, OwnChunkOnly, capture, continue_real_video, fastar, psnr, testbed  # noqa: E402

HISTORY, GENERATED, LAYER = 48, 6, 15


def concentration(model, context, hw, history, layer):
    kv, _, query_q, _ = capture(model, context, history, [layer], height=hw[0], width=hw[1])
    tpf = kv.tokens_per_frame
    n = (history + CHUNK) * tpf
    q, k = query_q[layer][0, ::37].float(), kv.k[layer, 0, :n].float()  # every 37th query
    p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5, -1)
    top = p.sort(-1, descending=True).values.cumsum(-1)
    return {"history_mass": p[..., :history * tpf].sum(-1).mean().item(),
            **{f"top{pct}pct": top[..., n * pct // 100].mean().item() for pct in (1, 5, 10)}}


def probe(setting: str, size="1.3B", device="cuda", hw=(480, 832), history=HISTORY, layer=LAYER):
    if setting == "plain":
        model32, context = testbed(sensitive=False, dtype=torch.float32, size=size, device=device)
    else:
        qk_gain, k_noise, self_gain, cross_gain = (float(x) for x in setting.split(":"))
        model32, context = testbed(dtype=torch.float32, size=size, device=device, qk_gain=qk_gain, k_noise=k_noise,
                                   self_gain=self_gain)
        for block in model32.blocks:
            block.cross_attn.o.weight.mul_(cross_gain)

    def gen(model, ctx, cache, attention=None):
        run = fastar.Rollout(model, ctx, frames=history + GENERATED, height=hw[0], width=hw[1], chunk_frames=CHUNK,
                             cache=cache)
        if attention is not None:
            run.attention = attention(run.cache)
        with torch.inference_mode():
            return continue_real_video(run, history)
    unbounded = fastar.CacheConfig("unbounded")
    torch.backends.cuda.matmul.allow_tf32 = False
    ref32 = gen(model32, context.float(), unbounded)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, context = model32.to(torch.bfloat16), context.to(torch.bfloat16)
    ref = gen(model, context, unbounded)
    annsa = fastar.AnnConfig(annca=False)
    return {"noise_floor": psnr(ref, ref32),
            "own_only": psnr(gen(model, context, unbounded, OwnChunkOnly), ref),
            "window3+6": psnr(gen(model, context, fastar.CacheConfig("window", 3, 6)), ref),
            "tempcache": psnr(gen(model, context, fastar.TempCacheConfig()), ref),
            "annsa": psnr(gen(model, context, unbounded, lambda c: fastar.FastARAttention(c, ann=annsa)), ref),
            "concentration": concentration(model, context, hw, history, layer)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="plain,1.5:0.5:1:1,1.5:0.5:5:1,1.5:0.5:5:0.1",
                    help="'plain' or qk_gain:k_noise:self_gain:cross_gain, comma-separated")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU at 64x96: checks the script only")
    args = ap.parse_args()
    where = dict(size="tiny", device="cpu", hw=(64, 96), history=6, layer=1) if args.smoke else {}
    rows = {}
    for setting in args.settings.split(","):
        rows[setting] = probe(setting, **where)
        print(setting, json.dumps(rows[setting]), flush=True)
    name = "testbed_probe_smoke.json" if args.smoke else "testbed_probe.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
                   "date": datetime.date.today().isoformat(), "settings": rows}, f, indent=1)


if __name__ == "__main__":
    main()
