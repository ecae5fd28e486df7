"""Fidelity after 81 real cached frames: which part of FAST-AR's combination costs PSNR.

bench/e2e_bench.py's fidelity table (PSNR / SSIM of generated latents against dense bf16, sensitized testbed,
Gaussian prompt) over ablations of the combined setting: AnnSA's history sort with no sparse step
(dense_steps_fraction 1.0), AnnSA reading every key block (keep 1.0), and lsh instead of quant. Then each of
dense, TempCache and the sort-only setting runs twice more: the PSNR between two runs of one setting is its
run-to-run variability on this device, the scale below which a gap between settings means nothing. Last, all of
FAST-AR with quant scoring blocks of 64 and of 128 keys.

    python bench/fidelity_ablation.py            # about 2 minutes on an H200; prints the table
    python bench/fidelity_ablation.py --smoke    # tiny model on the CPU: checks the script only
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_bench as E  # noqa: E402
from testbed import continue_real_video, psnr, testbed  # noqa: E402

smoke = "--smoke" in sys.argv
dev, size, hw, hor = ("cpu", "tiny", (64, 96), 9) if smoke else ("cuda", "1.3B", (480, 832), 81)
A, T = E.AnnConfig, E.TempCacheConfig
E.SETTINGS.clear()
E.SETTINGS.update({
    "dense": (E.CacheConfig("unbounded"), None),
    "tempcache": (T(), None),
    "fastar": (T(), A()),
    "fastar_sort_only": (T(), A(dense_steps_fraction=1.0)),
    "fastar_keep1": (T(), A(keep_fraction=1.0)),
    "fastar_lsh": (T(), A(method="lsh")),
})
model32, ctx32 = testbed(dtype=torch.float32, size=size, device=dev)
model, ctx = testbed(dtype=torch.bfloat16, size=size, device=dev)
E.fidelity(model, model32, ctx32.to(model.dtype), [hor], hw, 2 * E.CHUNK)


def generate(name):
    run = E.make_run(model, ctx, hor + 2 * E.CHUNK, hw, name)
    with torch.inference_mode():
        return continue_real_video(run, hor)


for name in ("dense", "tempcache", "fastar_sort_only"):
    a, b = generate(name), generate(name)
    print(f"run to run, {name}: {psnr(a, b):.1f} dB" if not torch.equal(a, b) else f"run to run, {name}: identical",
          flush=True)
    if name == "dense":
        ref = a

for kb in (64, 128):  # quant scoring blocks of kb history keys (ann.KEY_BLOCK)
    with E.key_block(kb):
        print(f"key blocks of {kb}, fastar: {psnr(generate('fastar'), ref):.2f} dB", flush=True)
