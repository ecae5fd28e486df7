"""``fastar`` with no arguments: the pack's trained world model flies over a photograph it never saw in
training, once with the sink + window cache and once with TempCache, and writes what each remembers.

The camera's route comes from ``--actions`` (action text, ``fastar.actions.parse_actions``) or, by default,
an out-and-back: a lead-in, a loop of ``--revisit`` video frames that takes a place out of view, and the
way back over it. The model is shown the ground truth up to the loop (``observed``) and makes the rest.
The window holds its sink and its last frames, so the place is gone when the camera returns; TempCache
holds as many frames' worth of tokens, merged where keys repeat, and can still hold the place. Writes a
side-by-side GIF (ground truth | window | TempCache, the revisit framed in red) and four of its moments
as a PNG, a plot of each cache's latency and size per chunk, and a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from . import photo_world
from .actions import MAX_TEXT, parse_actions
from .config import CacheConfig, TempCacheConfig
from .errors import FastARError
from .plot import plot_rollout
from .threads import HELP as THREADS_HELP, on, set_cpu_threads

PANEL = 128  # pixels a 64-pixel frame is drawn at


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="fastar rollout --help: long rollouts of Wan 2.1 models (random weights or a "
                                       "--checkpoint); fastar convert --help: checkpoints for ComfyUI")
    p.add_argument("--world", default=photo_world.DEMO_PHOTO,
                   help="the photograph to fly over (default: a held-out one shipped with the pack); at least "
                        "64 px a side, and large enough for the route")
    p.add_argument("--actions", help="the route as action text, e.g. 'D*4, W+D*2, look_left*6f, zoom_in, idle' "
                                     "(counts in chunks of 12 video frames, or frames with f; keys W S A D zoom_in "
                                     f"zoom_out, look_up/down/left/right, idle; at most {MAX_TEXT} characters). "
                                     "Default: an out-and-back of --revisit frames")
    p.add_argument("--revisit", type=int, default=96,
                   help="the default route: video frames between leaving a place and coming back, a multiple of 12 "
                        "from 36 (default 96)")
    p.add_argument("--observe", type=int,
                   help="video frames of ground truth shown to the model first, a multiple of 12 (default: up to "
                        "the loop on the default route, 12 with --actions)")
    p.add_argument("--max-cache-frames", type=int, default=TempCacheConfig.max_cache_frames,
                   help=f"TempCache's budget in latent frames, sink included (default "
                        f"{TempCacheConfig.max_cache_frames})")
    p.add_argument("--merge-threshold", type=float, default=TempCacheConfig.merge_threshold,
                   help=f"TempCache's merge threshold (default {TempCacheConfig.merge_threshold})")
    p.add_argument("--window-frames", type=int, default=CacheConfig.window_frames,
                   help=f"the window cache's recent frames beside its sink of {CacheConfig.sink_frames} (default "
                        f"{CacheConfig.window_frames}: LongLive's, the window TempCache's default costs as much as "
                        f"at Wan 2.1 1.3B's shapes)")
    p.add_argument("--model", default=photo_world.WEIGHTS, help="a world model file (default: the pack's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--out", default="fastar_world", help="folder for world.gif, world_strip.png, world_latency.png "
                                                         "and world.json (default ./fastar_world)")
    return p


def writable_folder(path: str, flag: str) -> None:
    """``path`` made a folder and written to once, or a one-line refusal naming ``flag``."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise FastARError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def model_size(model) -> str:
    """The model's parameter count in words: 7.5 M."""
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"


def route(args, spec, photo) -> tuple[np.ndarray, int, range | None]:
    """(actions per video frame, observed video frames, revisited frames or None)."""
    chunk = 12  # video frames per chunk: 3 latent frames of 4
    if args.actions is None:
        if args.revisit < 36 or args.revisit % chunk:
            raise FastARError(f"--revisit {args.revisit}: a loop of whole chunks ({chunk} video frames each) and at "
                              f"least 36 frames, so that the way back retraces its first leg")
        r = photo_world.revisit_actions(spec.actions, args.revisit, tuple(photo.shape[1:]), spec.view,
                                   np.random.default_rng(args.seed))
        actions, observed, revisit = r.actions, r.lead_in + chunk, r.revisit
    else:
        try:
            actions, observed, revisit = parse_actions(args.actions, spec.actions, chunk), chunk, None
        except FastARError as exc:
            raise FastARError(f"--actions: {exc}") from None
        pad = -len(actions) % chunk
        if pad:  # whole chunks: the last one held idle
            actions = np.concatenate([actions, np.zeros((pad, actions.shape[1]), np.float32)])
        actions = np.concatenate([np.zeros((chunk, actions.shape[1]), np.float32), actions])  # observed, still
    if args.observe is not None:
        if args.observe < chunk or args.observe % chunk:
            raise FastARError(f"--observe {args.observe}: must be a positive multiple of {chunk} video frames")
        observed = args.observe
    if observed >= len(actions):
        raise FastARError(f"--observe {observed}: the route has only {len(actions)} video frames; nothing is left "
                          f"to generate")
    return actions, observed, revisit


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (10 * torch.log10(4 / (x.float() - ref.float()).pow(2).mean().clamp_min(1e-10))).item()


def _frame(columns: dict[str, torch.Tensor], j: int, observed: int, revisit: range | None):
    """Video frame j of every column side by side, labelled; a revisit's frames framed in red."""
    from PIL import Image, ImageDraw

    label_h, pad = 30, 6
    im = Image.new("RGB", (len(columns) * (PANEL + pad) + pad, PANEL + 2 * label_h), (20, 20, 20))
    draw = ImageDraw.Draw(im)
    for i, (name, video) in enumerate(columns.items()):
        frame = ((video[0, :, j].clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
        x = pad + i * (PANEL + pad)
        im.paste(Image.fromarray(frame).resize((PANEL, PANEL), Image.NEAREST), (x, label_h))
        draw.text((x, 8), name, fill=(235, 235, 235))
        if revisit is not None and j in revisit:
            draw.rectangle([x - 2, label_h - 2, x + PANEL + 1, label_h + PANEL + 1], outline=(230, 40, 40), width=3)
    note = ("shown the ground truth" if j < observed else
            "revisit: a place last seen earlier" if revisit is not None and j in revisit else "generated")
    draw.text((pad, label_h + PANEL + 9), f"frame {j:3d}  {note}", fill=(200, 200, 200))
    return im


def gif(path, columns: dict[str, torch.Tensor], observed: int, revisit: range | None) -> None:
    """The videos side by side as an animated GIF (12 frames a second)."""
    n = next(iter(columns.values())).shape[2]
    images = [_frame(columns, j, observed, revisit) for j in range(n)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=83, loop=0, optimize=True)


def strip(path, columns: dict[str, torch.Tensor], observed: int, revisit: range | None) -> None:
    """Four moments as one PNG: the last frame shown, the route out, and the revisit (or, without one,
    four generated frames evenly spaced)."""
    from PIL import Image

    n = next(iter(columns.values())).shape[2]
    if revisit is not None:
        picks = [observed - 1, (observed + revisit.start) // 2, revisit.start + 2, revisit.stop - 1]
    else:
        picks = [observed - 1] + [observed + (n - 1 - observed) * k // 3 for k in (1, 2, 3)]
    frames = [_frame(columns, j, observed, revisit) for j in picks]
    out = Image.new("RGB", (frames[0].width, sum(f.height for f in frames)))
    for k, f in enumerate(frames):
        out.paste(f, (0, k * f.height))
    out.save(path)


def run(argv) -> dict:
    from tqdm import tqdm

    from .models import load_wan
    from .models.world import WorldModel

    args = parser().parse_args(argv)
    writable_folder(args.out, "--out")  # before the run, not after it
    threads = set_cpu_threads(args.threads)
    tic = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastARError(f"--device {args.device}: no CUDA device is available")
    if not os.path.isfile(args.model):
        raise FastARError(f"--model {args.model}: no such file")
    model = load_wan(args.model, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    if not isinstance(model, WorldModel):
        raise FastARError(f"--model {args.model}: a Wan video model, not a world model (fastar rollout "
                          f"--checkpoint runs those)")
    spec = model.spec
    photo = photo_world.load_photo(args.world, device)
    if min(photo.shape[1:]) < spec.view:
        raise FastARError(f"--world {args.world}: {photo.shape[2]}x{photo.shape[1]} px; the camera's view is "
                          f"{spec.view} px, the photograph must be at least that on each side")
    actions, observed, revisit = route(args, spec, photo)
    shipped = os.path.dirname(os.path.dirname(os.path.abspath(args.world))) == photo_world.PHOTOS
    if args.model == photo_world.WEIGHTS and not shipped:
        trained_on = len(os.listdir(os.path.join(photo_world.PHOTOS, "train")))
        print(f"fastar: the pack's world model ({model_size(model)} parameters) was trained on {trained_on} "
              f"photographs: over one of your own it drifts to texture within a few chunks (the held-out ones in "
              f"{os.path.join(photo_world.PHOTOS, 'heldout')} show what it remembers)", flush=True)
    flight = photo_world.flight(photo, actions, spec.view, observed, np.random.default_rng(args.seed + 1), revisit,
                           spec.actions)
    caches = {f"window (sink 3 + {args.window_frames})": CacheConfig("window", window_frames=args.window_frames),
              f"TempCache {args.max_cache_frames}": TempCacheConfig(merge_threshold=args.merge_threshold,
                                                                    max_cache_frames=args.max_cache_frames)}
    n, chunks = len(actions), (len(actions) - observed) // 12
    print(f"fastar: the world model ({os.path.basename(args.model)}) on {on(device, threads)} flies {n} video frames over "
          f"{os.path.basename(args.world)}: {observed} shown, {n - observed} generated in {chunks} chunks, "
          + (f"back over a place after {args.revisit} frames " if revisit is not None else "")
          + "with each cache:", flush=True)
    videos, rows = {}, {}
    bar = tqdm(total=chunks * len(caches), unit="chunk", desc="world", file=sys.stderr,
               disable=not sys.stderr.isatty())
    for name, cache in caches.items():
        rows[name] = []

        def on_chunk(r, rows=rows[name]):
            rows.append({"video_frames": 4 * r.frames_done, "latency_ms": 1e3 * r.latency_s,
                         "cache_tokens": r.cache.tokens_held, "dense_tokens": r.cache.dense_tokens,
                         "cache_gb": r.cache.held_gb, "dense_gb": r.cache.dense_gb, "merged": r.cache.merged})
            bar.update()

        with torch.inference_mode():
            videos[name] = photo_world.fly(model, flight, cache=cache, seed=args.seed, on_chunk=on_chunk)
    bar.close()
    os.makedirs(args.out, exist_ok=True)
    summary = {"model": os.path.basename(args.model), "world": os.path.basename(args.world), "device": str(device),
               "video_frames": n, "observed": observed, "revisit": [revisit.start, revisit.stop] if revisit else None,
               "caches": {}}
    sampled = slice(observed, n)
    for name, video in videos.items():
        r = rows[name]
        s = {"psnr_generated": psnr(video[:, :, sampled], flight.truth[:, :, sampled]),
             "ms_per_chunk": statistics.median(x["latency_ms"] for x in r[len(r) // 2:]),  # the cache full
             "tokens_held": r[-1]["cache_tokens"], "dense_tokens": r[-1]["dense_tokens"]}
        if revisit is not None:
            s["psnr_revisit"] = psnr(video[:, :, revisit.start:revisit.stop],
                                     flight.truth[:, :, revisit.start:revisit.stop])
        summary["caches"][name] = s
        print(f"  {name:24s} {s['ms_per_chunk']:7.1f} ms a chunk (median of the last half), holds {s['tokens_held']} of "
              f"{s['dense_tokens']} tokens; PSNR against the ground truth: generated frames {s['psnr_generated']:.1f} dB"
              + (f", the revisit {s['psnr_revisit']:.1f} dB" if revisit is not None else ""))
    paths = {k: os.path.join(args.out, f) for k, f in (("gif", "world.gif"), ("strip", "world_strip.png"),
                                                       ("plot", "world_latency.png"), ("json", "world.json"))}
    columns = {"ground truth": flight.truth, **videos}
    gif(paths["gif"], columns, observed, revisit)
    strip(paths["strip"], columns, observed, revisit)
    plot_rollout(rows, paths["plot"], f"the world model on {device}, {os.path.basename(args.world)}: per chunk")
    summary["seconds"] = round(time.perf_counter() - tic, 1)
    with open(paths["json"], "w") as f:
        json.dump({**summary, "chunks": rows}, f, indent=1)
    print(f"fastar: wrote {paths['gif']} (ground truth | window | TempCache; {paths['strip']}: four moments), "
          f"{paths['plot']}, {paths['json']} in {summary['seconds']:.0f} s")
    return summary
