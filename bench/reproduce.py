"""Regenerate every figure in bench/results: each by the benchmark command that wrote it, one after another.

Most need a CUDA GPU (an H200 made the committed ones); two need a ComfyUI tree (``--comfyui``; on a machine
without its dependencies see bench/comfy_site.py). A figure whose machine is not here is skipped and said so;
the exit status is 0 only when every figure asked for was written.

    python bench/reproduce.py --list                        # what it would run, where, and for how long
    python bench/reproduce.py --comfyui PATH                # every figure: ~42 minutes on an H200, ~35 on a CPU
    python bench/reproduce.py --only e2e_bench,core_bench   # some of them
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import BENCH, parser  # noqa: E402


@dataclass(frozen=True)
class Figure:
    name: str            # bench/results/<name>.png (and .json beside it)
    args: tuple          # the script and its arguments; --out is added
    gpu: bool            # needs a CUDA GPU
    comfyui: bool        # needs a ComfyUI tree: --comfyui (set as COMFYUI_PATH for the stream_memory runs)
    minutes: float       # on an H200 (the CPU stream_memory runs: on a 2-core CPU)
    shows: str

    def command(self, out: str, comfyui: str | None) -> list[str]:
        args = [a.replace("{comfyui}", comfyui or "PATH") for a in self.args]
        return [sys.executable, os.path.join(BENCH, args[0]), *args[1:], "--out", out]


FIGURES = (
    Figure("core_bench", ("core_bench.py",), True, False, 3,
           "dense unbounded and sink + window: latency and memory against cached frames"),
    Figure("tempcache_bench", ("tempcache_bench.py",), True, False, 5,
           "TempCache: recall and error by threshold and budget, a 240-chunk rollout's latency and memory"),
    Figure("ann_bench", ("ann_bench.py",), True, False, 2.5,
           "AnnSA's fixed-share plans on the clip's real prompt: recall and speed against density"),
    Figure("ann_bench_random", ("ann_bench.py", "--prompt", "random", "--tag", "ann_bench_random"), True, False, 2.5,
           "the same on a Gaussian prompt (the harder test)"),
    Figure("e2e_bench", ("e2e_bench.py", "--skip-fidelity", "--component-chunks", "24"), True, False, 4,
           "2880 frames: FAST-AR and its components against dense, throughput and memory"),
    Figure("frontier", ("frontier.py",), True, False, 12,
           "ms per steady chunk against PSNR after 81 / 240 real frames: windows, TempCache, FAST-AR"),
    Figure("frontier_wan", ("frontier.py", "--prompt", "wan"), True, False, 12,
           "the same on the clip's real prompt"),
    Figure("comfy_bench", ("comfy_bench.py", "--comfyui", "{comfyui}"), True, True, 9,
           "the ComfyUI paths against the library, ms per chunk"),
    *(Figure(f"comfy_defaults_{p}", ("comfy_bench.py", "--comfyui", "{comfyui}", "--paths", "library,comfy-default,comfy-bf16",
                                    "--prompt", p, "--repeats", "2", "--chunks", "24", "--profile-at", "1000", "--tag",
                                    f"comfy_defaults_{p}"), True, True, 3,
             f"the defaults against sink 3 + window 12 through ComfyUI's loader and the nodes, {what}")
      for p, what in (("wan", "the clip's prompt"), ("random", "a Gaussian prompt"))),
    Figure("stream_memory", ("stream_memory.py", "--size", "64"), False, True, 35,
           "FAST-AR Save Video's peak memory by length against VAE Decode + Save Video"),
    Figure("sampler_stream_memory", ("stream_memory.py", "--size", "64", "--lengths", "61,241,601", "--paths",
                                     "sampler_stream,sampler_latent", "--tag", "sampler_stream_memory"), False, True,
           2.5, "the Long Sampler with FAST-AR Video Stream: the whole run's peak memory by length"),
    Figure("sampler_stream_memory_gpu", ("stream_memory.py", "--on-cuda", "--comfyui", "{comfyui}", "--lengths",
                                         "69,213,429", "--paths", "sampler_stream,sampler_latent", "--tag",
                                         "sampler_stream_memory_gpu"), True, True, 2,
           "the same at 832x480 on the GPU: peak GPU memory allocated by length"),
    Figure("world_train_loss", ("world_train.py", "--minutes", "8.2", "--total-minutes", "8.0", "--export",
                                "assets/world.safetensors"), True, False, 9,
           "the world model trained on 12 photographs: its loss curve (and the weights the pack ships)"),
    Figure("world_eval", ("world_eval.py",), True, False, 3,
           "every cache on the trained world: revisit PSNR against ms per chunk at N = 48-384"),
)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--list", action="store_true", help="print what would run, and run nothing")
    ap.add_argument("--only", help="comma-separated figure names (default: all)")
    ap.add_argument("--comfyui", help="a ComfyUI tree with core's autoregressive files (core-ar-2026)")
    args = ap.parse_args(argv)
    names = [f.name for f in FIGURES]
    chosen = args.only.split(",") if args.only else names
    if any(n not in names for n in chosen):
        ap.error(f"--only: choose among {', '.join(names)}")
    figures = [f for f in FIGURES if f.name in chosen]
    if args.list:
        for f in figures:
            where = ("GPU" if f.gpu else "CPU") + (" + ComfyUI" if f.comfyui else "")
            print(f"{f.name + '.png':22s} {where:15s} ~{f.minutes:g} min  {f.shows}\n    "
                  + " ".join(f.command(args.out, args.comfyui)[1:]))
        print(f"in all ~{sum(f.minutes for f in figures):g} minutes")
        return 0
    made, skipped, failed = [], [], []
    for f in figures:
        missing = ("a CUDA GPU" if f.gpu and not torch.cuda.is_available() else
                   "--comfyui" if f.comfyui and not args.comfyui else None)
        if missing:
            print(f"-- {f.name}: skipped, needs {missing}", flush=True)
            skipped.append(f.name)
            continue
        cmd = f.command(args.out, args.comfyui)
        print(f"-- {f.name}: {' '.join(cmd[1:])}", flush=True)
        env = {**os.environ, "COMFYUI_PATH": args.comfyui} if f.comfyui else None
        (made if subprocess.run(cmd, env=env).returncode == 0 else failed).append(f.name)
    print(f"written: {', '.join(made) or 'none'}" + (f"; skipped: {', '.join(skipped)}" if skipped else "")
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 0 if len(made) == len(figures) else 1


if __name__ == "__main__":
    sys.exit(main())
