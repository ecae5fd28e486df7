"""``fastar``: the pack's trained world model over a photograph (``fastar.world_demo``, the default);
``fastar rollout``: a long autoregressive rollout of a Wan 2.1 model, latency and cache size per chunk;
``fastar convert``: a causal checkpoint as the file ComfyUI and ``fastar rollout --checkpoint`` load.

``fastar rollout`` with no arguments runs TempCache on a tiny random Wan model on the CPU, or on the
Wan 2.1 1.3B shapes (480x832, bf16, random weights) when a GPU is present. ``fastar convert SRC.pt
DST.safetensors [--preset NAME]`` records the checkpoint's sampling, which ``--checkpoint`` then
samples with.

Under torchrun (``torchrun --nproc-per-node N -m comfyui_fastar.fastar rollout ...``) the N processes
run one rollout head-parallel (``fastar.parallel``): each holds 1/N of the attention heads and of the
KV cache (NCCL on GPUs, one GPU per process; gloo on the CPU); rank 0 prints, plots and writes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from .config import CACHE_MODES, AnnConfig, CacheConfig, TempCacheConfig
from .errors import FastARError
from .frames import video_frames
from .parallel import group_size, init_group
from .models import (KNOWN_CHECKPOINTS, WAN_CONFIGS, Sampling, build_model, checkpoint_sampling,
                     convert_checkpoint, fp8_linears, load_wan)
from .models.convert import MATRIX_GAME_PRESET
from .plot import plot_rollout
from .rollout import Rollout, pad_context
from .schedule import FlowMatchSchedule
from .threads import HELP as THREADS_HELP, on, set_cpu_threads

# (model size, pixel height, width, latent frames, dtype) of the embedded defaults
DEFAULTS = {"cpu": ("tiny", 256, 256, 96, "float32"), "cuda": ("1.3B", 480, 832, 120, "bfloat16")}
TEXT_TOKENS = 512  # umT5 prompt length the Wan models are trained with (a random prompt fills it)
DEFAULT_SAMPLING = Sampling(3, (1000, 750, 500, 250), 5.0)  # Self-Forcing's, where a checkpoint records none


def rollout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastar rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, help="latent frames to generate (N of them decode to 1 + 4 (N - 1) video "
                                              "frames); default 96 on CPU, 120 on GPU")
    p.add_argument("--chunk-frames", type=int, help="latent frames per chunk (1 or 3; default: the frames per block "
                                                     "the --checkpoint records, else 3)")
    p.add_argument("--cache", choices=CACHE_MODES + ("tempcache",), default="tempcache",
                   help="KV cache: every frame (unbounded, the dense baseline), a sink + sliding window, or "
                        "TempCache: sink + a token budget with merging (default)")
    p.add_argument("--sink-frames", type=int, help=f"window/tempcache: first frames always kept (default "
                   f"{CacheConfig.sink_frames} for window, {TempCacheConfig.sink_frames} for tempcache)")
    p.add_argument("--window-frames", type=int, default=CacheConfig.window_frames,
                   help=f"window cache: recent frames kept (default {CacheConfig.window_frames})")
    p.add_argument("--max-cache-frames", type=int, default=TempCacheConfig.max_cache_frames,
                   help=f"tempcache: token budget in latent frames, sink included (default "
                        f"{TempCacheConfig.max_cache_frames})")
    p.add_argument("--merge-threshold", type=float, default=TempCacheConfig.merge_threshold,
                   help=f"tempcache: key cosine similarity two tokens need to merge "
                        f"(default {TempCacheConfig.merge_threshold})")
    p.add_argument("--recall-frames", type=int, default=TempCacheConfig.recall_frames,
                   help="tempcache: the memory tier: frames also kept in host memory (up to 16 GiB, then the oldest "
                        "thinned), and each chunk attends this many older frames recent queries favour beside the "
                        "budget (not with --annsa; default 0: off)")
    p.add_argument("--annsa", action="store_true",
                   help="AnnSA sparse self-attention at the default AnnConfig (needs --cache tempcache or unbounded); "
                        "pays only with long budgets (--max-cache-frames 21 and more), on content whose attention "
                        "spreads over the history (default off)")
    p.add_argument("--keep-mass", type=float, help="--annsa: each query block reads history blocks until they, the "
                   "sink and its own chunk hold this share of its estimated attention mass; 0: --keep-fraction "
                   f"alone (default {AnnConfig.keep_mass})")
    p.add_argument("--keep-fraction", type=float, help="--annsa: share of history blocks each query block reads "
                   f"at least (default {AnnConfig.keep_fraction})")
    p.add_argument("--model", choices=sorted(WAN_CONFIGS), help="random-weight model size "
                                                                "(default tiny on CPU, 1.3B on GPU)")
    p.add_argument("--checkpoint", help="a Wan 2.1 T2V / causal .safetensors checkpoint to run instead")
    p.add_argument("--context", help="a .safetensors file holding a text embedding 'context' [tokens, text_dim] "
                                     "(default: seeded random features)")
    p.add_argument("--height", type=int, help="pixel height, a multiple of 16 (default 256 CPU / 480 GPU)")
    p.add_argument("--width", type=int, help="pixel width, a multiple of 16 (default 256 CPU / 832 GPU)")
    p.add_argument("--timesteps", help="denoising timesteps (default: the --checkpoint's recorded ones, else "
                                       "1000,750,500,250)")
    p.add_argument("--shift", type=float, help="flow-matching timestep shift (default: the --checkpoint's recorded "
                                               "one, else 5)")
    p.add_argument("--context-noise", type=float, default=0.0, help="timestep of the clean cache pass (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--eager", action="store_true", help="CUDA: launch every chunk op by op instead of replaying "
                                                         "repeating chunks from a CUDA graph")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--fp8-linears", action="store_true",
                   help="the blocks' linear layers as fp8 matmuls (faster at the 14B's shapes, slower at the 1.3B's; "
                        "bf16 / fp16 on a GPU with fp8 tensor cores)")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="under torchrun: seconds a rank waits for the others before the run fails (default 120)")
    p.add_argument("--plot", default="fastar_rollout.png", help="PNG plot path (default fastar_rollout.png)")
    p.add_argument("--json", help="also write the per-chunk table as JSON here")
    p.add_argument("--save-latents", help="write the generated latent video to this .safetensors file")
    return p


def parse_args(argv):
    return rollout_parser().parse_args(argv)


def load_context(path, text_dim, device, dtype):
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as exc:
        raise FastARError(f"--context {path}: not a readable safetensors file ({exc})") from None
    if "context" not in tensors:
        raise FastARError(f"--context {path}: no tensor named 'context' (found {sorted(tensors)})")
    ctx = tensors["context"]
    ctx = ctx[None] if ctx.ndim == 2 else ctx
    if ctx.ndim != 3 or ctx.shape[-1] != text_dim:
        raise FastARError(f"--context {path}: expected [tokens, {text_dim}], got {tuple(tensors['context'].shape)}")
    return ctx.to(device, dtype)


def run(args) -> list[dict]:
    args.threads = set_cpu_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastARError(f"--device {args.device}: no CUDA device is available")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))  # under torchrun: a GPU per process
        if local >= torch.cuda.device_count():  # else NCCL waits out its timeout on two ranks sharing a GPU
            raise FastARError(f"local rank {local} under torchrun needs GPU {local}, and this machine shows "
                              f"{torch.cuda.device_count()}: start at most that many processes a node "
                              f"(torchrun --nproc_per_node), or run them with --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    group = init_group(timeout_s=args.dist_timeout, device=device)  # under torchrun: head parallelism
    try:
        return _run(args, device, group)
    finally:
        if group is not None:
            torch.distributed.destroy_process_group()


def _run(args, device, group) -> list[dict]:
    from tqdm import tqdm

    world, rank = (1, 0) if group is None else (group_size(group), torch.distributed.get_rank(group))
    say = print if rank == 0 else (lambda *a, **k: None)
    size, height, width, frames, dtype = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    dtype = getattr(torch, args.dtype or dtype)
    sampling = DEFAULT_SAMPLING
    if args.checkpoint:
        model = load_wan(args.checkpoint, device=device, dtype=dtype)
        label = args.checkpoint
        recorded = checkpoint_sampling(args.checkpoint)
        if recorded is not None:
            sampling = recorded
            if None in (args.chunk_frames, args.timesteps, args.shift):
                label += f" (sampled as it records: {recorded.describe()})"
    else:
        size = args.model or size
        model = build_model(size, device=device, dtype=dtype, seed=args.seed)
        label = f"Wan 2.1 {size} (random weights)"
    if args.fp8_linears:
        if dtype not in (torch.bfloat16, torch.float16):
            raise FastARError(f"--fp8-linears needs --dtype bfloat16 or float16 (the model computes in "
                              f"{str(dtype).replace('torch.', '')})")
        model, label = fp8_linears(model), f"{label}, fp8 linears"
    height, width, frames = args.height or height, args.width or width, args.frames or frames
    if args.context:
        context = load_context(args.context, model.context_dim, device, dtype)
    else:
        g = torch.Generator().manual_seed(args.seed)
        context = torch.randn(1, TEXT_TOKENS, model.context_dim, generator=g).to(device, dtype)
    context = pad_context(context, model.context_len)
    sink = {} if args.sink_frames is None else {"sink_frames": args.sink_frames}  # else the config's default
    if args.cache == "tempcache":
        cache = TempCacheConfig(merge_threshold=args.merge_threshold, max_cache_frames=args.max_cache_frames,
                                recall_frames=args.recall_frames, **sink)
    else:
        cache = CacheConfig(args.cache, window_frames=args.window_frames, **sink)
    args.chunk_frames = args.chunk_frames or sampling.frames_per_block
    shift = sampling.shift if args.shift is None else args.shift
    schedule = (FlowMatchSchedule.parse(args.timesteps, shift) if args.timesteps is not None
                else FlowMatchSchedule(sampling.timesteps, shift))
    if frames % args.chunk_frames:
        raise FastARError(f"--frames {frames} is not divisible by --chunk-frames {args.chunk_frames}")

    keep = {k: v for k, v in (("keep_mass", args.keep_mass), ("keep_fraction", args.keep_fraction)) if v is not None}
    if keep and not args.annsa:
        raise FastARError(f"--{next(iter(keep)).replace('_', '-')} sets AnnSA's plan: add --annsa")
    ann = AnnConfig(**keep) if args.annsa else None
    engine = Rollout(model, context, frames=frames, height=height, width=width, chunk_frames=args.chunk_frames,
                     schedule=schedule, cache=cache, seed=args.seed, context_noise=args.context_noise, ann=ann,
                     cuda_graphs=not args.eager, group=group)
    say(f"fastar: {label} on {on(device, args.threads)} ({str(dtype).replace('torch.', '')}), {video_frames(frames)} video frames "
          f"({frames} latent) at "
          f"{width}x{height}, chunks of {args.chunk_frames}, {len(schedule.timesteps)} steps, cache {args.cache}"
          + (f" (sink {cache.sink_frames}, window {args.window_frames})" if args.cache == "window" else "")
          + (f" (budget {args.max_cache_frames} frames, sink {cache.sink_frames}, threshold {args.merge_threshold}"
             + (f", recall {args.recall_frames} frames from host memory" if args.recall_frames else "") + ")"
             if args.cache == "tempcache" else "")
          + (", AnnSA sparse attention" if ann is not None else "")
          + (", repeating chunks replayed from a CUDA graph" if engine.cuda_graphs and engine.attention.graph_safe else "")
          + (f", head-parallel over {world} ranks ({model.num_heads // world} of {model.num_heads} heads per rank; "
             f"cache sizes per rank)" if world > 1 else ""))
    rows = []
    # the bar only on a terminal: in a log file its carriage returns would garble the chunk lines
    bar = tqdm(total=video_frames(frames), unit="frame", desc="rollout (video frames)", file=sys.stderr,
               disable=rank != 0 or not sys.stderr.isatty())

    def on_chunk(r):
        rows.append({"chunk": r.chunk, "frames": r.frames_done, "video_frames": video_frames(r.frames_done),
                     "latency_ms": 1e3 * r.latency_s,
                     "cache_tokens": r.cache.tokens_held, "cache_gb": r.cache.held_gb,
                     "allocated_gb": r.cache.gb, "dense_gb": r.cache.dense_gb, "merged": r.cache.merged,
                     "evicted": r.cache.evicted})
        if r.annsa_density is not None:
            rows[-1]["annsa_density"] = r.annsa_density
        if r.annsa_sparse is not None:
            rows[-1]["annsa_sparse"] = r.annsa_sparse
        bar.update(video_frames(r.frames_done) - bar.n)
        if rank == 0:
            tqdm.write(f"chunk {r.chunk + 1:4d}/{r.num_chunks} | frames {video_frames(r.frames_done):5d}/"
                       f"{video_frames(r.total_frames)} video ({r.frames_done}/{r.total_frames} latent) | "
                       f"{1e3 * r.latency_s:9.1f} ms | cache {r.cache.tokens_held:8d} tok {r.cache.held_gb:7.3f} GB "
                       f"(allocated {r.cache.gb:7.3f}, dense {r.cache.dense_gb:7.3f} GB)"
                       + (f" | AnnSA reads {r.annsa_density:4.0%}" if r.annsa_density is not None else "")
                       + (f", sparse in {r.annsa_sparse:4.0%} of layers" if r.annsa_sparse is not None else ""))

    with torch.inference_mode():
        latents = engine.run(on_chunk)
    bar.close()
    if rank != 0:
        return rows
    plot_rollout({args.cache + (" + AnnSA" if ann is not None else ""): rows}, args.plot,
                 f"{label}, {width}x{height}, chunk {args.chunk_frames}, "
                 f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    steady = rows[len(rows) // 2:]  # the cache full, repeating chunks replayed
    last = rows[-1]
    ms = statistics.median(r["latency_ms"] for r in steady)
    print(f"fastar: {len(rows)} chunks, {last['video_frames']} video frames; {ms:.1f} ms a chunk (median of the "
          f"last {len(steady)}); the cache holds {last['cache_gb']:.3f} GB against a dense cache's "
          f"{last['dense_gb']:.3f} GB ({last['cache_tokens']} tokens); plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "model": label, "frames": frames, "video_frames": video_frames(frames),
                       "height": height, "width": width,
                       "chunk_frames": args.chunk_frames, "cache": args.cache, "annsa": args.annsa, "ranks": world,
                       "chunks": rows}, f,
                      indent=1)
    if args.save_latents:
        from safetensors.torch import save_file
        save_file({"latent": latents.cpu().contiguous()}, args.save_latents)
    return rows


def parse_convert_args(argv, prog: str = "fastar convert"):
    known = ", ".join(f"{c.name} ({c.repo})" for c in KNOWN_CHECKPOINTS.values()) \
        + f", {MATRIX_GAME_PRESET} (Skywork/Matrix-Game-2.0: its variant read off the file)"
    p = argparse.ArgumentParser(prog=prog,
                                description="Write a causal Wan 2.1 checkpoint (a training .pt: Self-Forcing, CausVid, "
                                            "LongLive, Causal-Forcing, Rolling Forcing ...; or a .safetensors file) "
                                            "as a .safetensors file for ComfyUI's models/diffusion_models/ and fastar "
                                            "--checkpoint, with the checkpoint's sampling in its metadata. A .pt "
                                            "file is read with torch's weights-only unpickler: no code in it runs.")
    p.add_argument("src", help="the checkpoint (.pt or .safetensors)")
    p.add_argument("dst", help="the .safetensors file to write")
    p.add_argument("--preset", choices=sorted([*KNOWN_CHECKPOINTS, MATRIX_GAME_PRESET]), metavar="NAME",
                   help=f"which published checkpoint SRC is: its entry, LoRA settings and sampling. One of: {known}")
    p.add_argument("--key", help="the entry holding the model's weights (default: the preset's, else the first of "
                                 "generator_ema, generator, model, state_dict, module)")
    p.add_argument("--lora", help="a LoRA file (LongLive's lora.pt) to merge into the weights")
    p.add_argument("--lora-key", help="the LoRA file's entry holding the generator's adapters (default "
                                      "generator_lora where the file has one)")
    p.add_argument("--lora-alpha", type=float, help="the LoRA's alpha: each layer gets W + alpha / rank * B @ A "
                                                    "(default: the preset's, else alpha = rank)")
    p.add_argument("--frames-per-block", type=int, help="latent frames per block the model was trained with "
                                                         "(recorded; default: the preset's)")
    p.add_argument("--timesteps", help="its denoising timesteps, comma-separated (recorded; default: the preset's)")
    p.add_argument("--shift", type=float, help="the shift that warps them (recorded; 1 keeps them as listed; "
                                               "default: the preset's)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="stored precision (default bfloat16, as the models are trained)")
    p.add_argument("--num-heads", type=int, help="attention heads, for a model whose width is not 128 per head")
    return p.parse_args(argv)


def _convert_sampling(args) -> Sampling | None:
    """The sampling --frames-per-block / --timesteps / --shift give, over the preset's where one is named."""
    given = {"frames_per_block": args.frames_per_block, "shift": args.shift,
             "timesteps": None if args.timesteps is None else FlowMatchSchedule.parse(args.timesteps).timesteps}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    base = KNOWN_CHECKPOINTS[args.preset].sampling if args.preset in KNOWN_CHECKPOINTS else None
    if base is None and len(given) < 3:
        missing = [f"--{k.replace('_', '-')}" for k in ("frames_per_block", "timesteps", "shift") if k not in given]
        raise FastARError(f"the sampling to record needs {', '.join(missing)} too (or a --preset to start from)")
    settings = {} if base is None else {"frames_per_block": base.frames_per_block, "timesteps": base.timesteps,
                                         "shift": base.shift}
    return Sampling(**{**settings, **given})


def convert(args, command: str = "fastar convert") -> None:
    done = convert_checkpoint(args.src, args.dst, preset=args.preset, key=args.key, lora=args.lora,
                              lora_key=args.lora_key, lora_alpha=args.lora_alpha, sampling=_convert_sampling(args),
                              dtype=getattr(torch, args.dtype), num_heads=args.num_heads, command=command)
    config = done.config
    print(f"wrote {args.dst}: {done.kind}, dim {config.dim}, {config.num_heads} heads, {config.num_layers} blocks, "
          f"{args.dtype}"
          + (f"; LoRA {os.path.basename(args.lora)} merged into {done.lora_layers} linear layers" if args.lora else "")
          + (f"; sampling: {done.sampling.describe()}" if done.sampling is not None else
             "; no sampling recorded (name the checkpoint with --preset, or give --frames-per-block, --timesteps "
             "and --shift)"))


def _rollout_flag(argv) -> str | None:
    """The first flag in ``argv`` that only ``fastar rollout`` takes (a user who meant a Wan rollout)."""
    from .world_demo import parser as world_parser

    def flags(parser):
        return {o for a in parser._actions for o in a.option_strings}

    only = flags(rollout_parser()) - flags(world_parser())
    return next((a.split("=")[0] for a in argv if a.split("=")[0] in only), None)


def main(argv=None, convert_command: str = "fastar convert") -> int:
    """``convert_command``: how the user runs the converter (``convert.py`` in a cloned pack), named in
    its usage and in the command a refusal ends with."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["convert"]:
            convert(parse_convert_args(argv[1:], convert_command), convert_command)
            return 0
        if argv[:1] == ["rollout"]:
            run(parse_args(argv[1:]))
            return 0
        flag = _rollout_flag(argv)
        if flag is not None:
            raise FastARError(f"{flag} belongs to Wan 2.1 rollouts: fastar rollout {' '.join(argv)}")
        from .world_demo import run as fly_world
        fly_world(argv)
    except FastARError as exc:
        print(f"fastar: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
