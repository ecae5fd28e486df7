"""What a bounded re-cache changes: the chunks after a prompt switch when the switch re-encodes only what the
cache reaches (``Rollout.recache_chunks``: the sink's chunks and the most recent frames the policy keeps) against
re-encoding every frame so far through the same fresh cache, for sink 3 + window 12 and TempCache at the
pack's defaults.

Two things differ. Both caches: the first re-encoded recent frames are encoded without the frames before them
as context. TempCache: its merged groups count only the re-encoded frames' tokens, where a full re-cache
would have merged older tokens into them (and evicted by age among all of them). Measured as the PSNR and
relative error between the two rollouts' latents after the switch, beside the gap between the two caches
themselves (each fully re-cached) for scale. The sensitized random-weight testbed (bench/common/testbed.py),
the real clip's prompt switched to a Gaussian one; chunks of 3 latent frames.

    python bench/recache_fidelity.py --out bench/results                       # 1.3B at 480x832 on a GPU
    python bench/recache_fidelity.py --device cpu --height 64 --width 96       # 1.3B weights, small frames, CPU
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, random_prompt, write_json  # noqa: E402
from common.testbed import CHUNK, psnr, testbed  # noqa: E402

CACHES = {
    "window_3_12": lambda: fastar.CacheConfig("window", sink_frames=3, window_frames=12),
    "tempcache_defaults": lambda: fastar.TempCacheConfig(),
}


def distance(a: torch.Tensor, b: torch.Tensor, what: str) -> dict:
    """PSNR (dB) and relative error of latents ``a`` against ``b``."""
    return {f"psnr_{what}_db": round(psnr(a, b), 2), f"rel_{what}": round(((a - b).norm() / b.norm()).item(), 5)}


class FullRecache(fastar.Rollout):
    """A rollout whose prompt switches re-encode every frame so far, as an unbounded cache's do."""

    def recache_chunks(self, frames_done: int) -> tuple[range, range]:
        chunks = (frames_done - self.first_frame) // self.chunk_frames
        return range(chunks), range(chunks, chunks)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="1.3B")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--switch-after", type=int, default=10, help="chunks before the switch (default 10)")
    p.add_argument("--after", type=int, default=3, help="chunks generated after it (default 3)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, context = testbed(dtype=dtype, size=args.size, device=args.device, prompt="wan")
    other = random_prompt(model.context_dim, args.device, dtype)
    frames = (args.switch_after + args.after) * CHUNK
    switch = args.switch_after * CHUNK
    out, rows = {}, {}
    tic = time.time()
    for name, make in CACHES.items():
        for label, cls in (("bounded", fastar.Rollout), ("full", FullRecache)):
            run = cls(model, context, frames=frames, height=args.height, width=args.width, chunk_frames=CHUNK,
                      cache=make(), prompts=[(args.switch_after, other)], seed=0)
            with torch.inference_mode():
                out[name, label] = run.run()[:, :, switch:].float().cpu()
            print(f"[{time.time() - tic:.0f} s] {name} {label}", flush=True)
            if label == "bounded":
                sink, recent = run.recache_chunks(switch)
        rows[name] = {"chunks_re_encoded_bounded": len(sink) + len(recent), "chunks_re_encoded_full": args.switch_after,
                      **distance(out[name, "bounded"], out[name, "full"], "bounded_vs_full")}
        print(name, rows[name], flush=True)
    result = {**header(args.device), "size": args.size, "shape": f"{args.width}x{args.height}", "chunk_frames": CHUNK,
              "switch_after_chunks": args.switch_after, "chunks_after": args.after,
              "testbed": "sensitized random weights (bench/common/testbed.py); the clip's prompt, then a Gaussian one",
              "caches": rows, "scale": distance(out["tempcache_defaults", "full"], out["window_3_12", "full"],
                                                "tempcache_vs_window_both_full")}
    print("scale (the two caches, each fully re-cached):", result["scale"])
    write_json(args.out, "recache_fidelity.json", result)


if __name__ == "__main__":
    main()
