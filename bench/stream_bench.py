"""A long video to disk through ComfyUI: video frames a second end to end, sampling, decode and writing
included, with the Wan VAE or a TAEHV-family decoder, the writer one step after the sampling or beside it.

Wan 2.1 1.3B's shapes (``common.testbed``'s sensitized random weights, 832x480, bf16, the clip's prompt)
loaded by ComfyUI's UNETLoader; FAST-AR's defaults; the Autoregressive Long Sampler (chunks of 3 latent
frames, 4 steps) with a FAST-AR Video Stream on its ``stream`` input, ``keep_latent`` off, called as
ComfyUI's executor calls nodes (inside ``torch.inference_mode``). The stream decodes with a Wan 2.1 VAE at
its real widths (random weights, Load VAE's class) or a TAEHV-family decoder at taew2_1's layout (random
weights, float16 as released, loaded by FAST-AR Load Fast Decoder: a ComfyUI with TAEHV). ``serial``: each
chunk decoded and written before the next samples; ``pipelined``: while it samples (``fastar.handoff``).

Per run: the node's wall time from its call to its return (the file closed), the frames in the file and so
frames a second, and the sampler's own ms a chunk (its ``fastar.cache`` events; the first two chunks, which
capture CUDA graphs, left out). One untimed warm-up run per decoder, then ``--repeats`` rounds of every
(decoder, loop); medians over rounds.

    python bench/stream_bench.py --comfyui PATH --out bench/results   # a GPU; PATH: a ComfyUI with TAEHV
    python bench/stream_bench.py --comfyui PATH --smoke --out /tmp    # the tiny model on the CPU: the script only
"""
from __future__ import annotations

import glob
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import header, parser, write_json  # noqa: E402
from common.comfyui import ChunkEvents, harness, load_unet  # noqa: E402

LOOPS = ("serial", "pipelined")
SKIP = 2  # chunks left out of the sampler's ms: the first capture CUDA graphs


def parse_args(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--comfyui", required=True, help="a ComfyUI tree (its comfy package is imported)")
    p.add_argument("--chunks", type=int, default=20, help="chunks of 3 latent frames (12 video frames) a run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every (decoder, loop)")
    p.add_argument("--decoders", default="wan,taehv", help="wan and/or taehv, comma-separated")
    args = p.parse_args(argv)
    args.decoders = args.decoders.split(",")
    if not args.decoders or set(args.decoders) - {"wan", "taehv"}:
        p.error("--decoders: wan and/or taehv")
    if args.smoke:
        args.chunks, args.repeats = min(args.chunks, 4), min(args.repeats, 1)
    return args


def decoders(args, work: str) -> dict:
    import comfy.sd
    import comfy.utils

    out = {}
    if "wan" in args.decoders:
        path = harness.wan_vae_file(os.path.join(work, "wan_2.1_vae.safetensors"))
        out["wan"] = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))
    if "taehv" in args.decoders:
        from comfyui_fastar.nodes.fast_decoder_nodes import load_fast_decoder

        path = harness.taehv_file(os.path.join(work, "taew2_1.safetensors"), dtype=torch.float16)
        out["taehv"] = load_fast_decoder(str(path), "stream_bench")
    return out


def run(unet, positive, dims, length, vae, prefix, work, device) -> dict:
    """One Long Sampler run into a Video Stream: wall seconds, frames written, the sampler's ms a chunk."""
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.stream import StreamSettings

    with ChunkEvents() as chunks:
        stream = StreamSettings(vae=vae, filename_prefix=prefix, keep_latent=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        tic = time.perf_counter()
        AutoregressiveLongSampler.execute(unet, positive, dims[1], dims[0], length, 1, 0, "1000,750,500,250", 5.0,
                                          "3", 0.0, 1.0, stream=stream)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - tic
    (path,) = glob.glob(os.path.join(work, f"{prefix}_*.mp4"))
    frames = len(harness.read_video(path)[0])
    os.remove(path)
    steady = chunks.seconds[SKIP:] or chunks.seconds
    return {"seconds": seconds, "frames": frames, "fps": frames / seconds,
            "chunk_ms": 1e3 * statistics.median(steady)}


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    comfy = harness.import_comfy(args.comfyui, cpu=device.type == "cpu")
    import comfy.cmd.folder_paths as folder_paths
    import comfy.model_management

    from comfyui_fastar.fastar import handoff

    work = tempfile.mkdtemp(prefix="fastar_stream_bench_")
    if args.smoke:
        from common.testbed import prompt_context

        model, dims, shape = harness.tiny_wan(), (32, 32), "tiny"
        context = prompt_context(model.context_dim)
    else:
        from common import testbed

        model, context = testbed.testbed(prompt="wan")
        dims, shape = (testbed.HEIGHT, testbed.WIDTH), "1.3B"
    harness.write_wan(model, work, "testbed", torch.bfloat16)
    del model
    folder_paths.add_model_folder_path("diffusion_models", work)
    folder_paths.get_output_directory = lambda: work
    positive = [[context.float().cpu(), {}]]
    length = (3 * args.chunks - 1) * 4 + 1
    rounds, saved = {}, handoff.PIPELINED
    try:
        with torch.inference_mode():
            unet = load_unet(comfy, "testbed.safetensors", None)
            comfy.model_management.load_models_gpu([unet])
            vaes = decoders(args, work)
            for name, vae in vaes.items():  # the decoder loaded, kernels compiled, graphs captured
                run(unet, positive, dims, 9, vae, f"warmup_{name}", work, device)
            for r in range(args.repeats):
                for name, vae in vaes.items():
                    for loop in LOOPS:
                        handoff.PIPELINED = loop == "pipelined"
                        row = run(unet, positive, dims, length, vae, f"{name}_{loop}_{r}", work, device)
                        rounds.setdefault(f"{name}/{loop}", []).append(row)
                        print(f"round {r} {name:5s} {loop:9s} {row['fps']:6.2f} frames/s ({row['frames']} in "
                              f"{row['seconds']:.2f} s), sampler {row['chunk_ms']:.1f} ms a chunk", flush=True)
    finally:
        handoff.PIPELINED = saved
    summary = {key: {"fps": statistics.median(r["fps"] for r in rows),
                     "seconds": statistics.median(r["seconds"] for r in rows),
                     "chunk_ms": statistics.median(r["chunk_ms"] for r in rows),
                     "frames": rows[0]["frames"]} for key, rows in rounds.items()}
    ratios = {f"{name} pipelined / serial": summary[f"{name}/pipelined"]["fps"] / summary[f"{name}/serial"]["fps"]
              for name in args.decoders}
    if len(args.decoders) == 2:
        ratios["taehv / wan, pipelined"] = summary["taehv/pipelined"]["fps"] / summary["wan/pipelined"]["fps"]
    result = {**header(device, None if argv is None else [__file__, *argv]),
              "shape": {"height": dims[0], "width": dims[1], "model": shape, "chunks": args.chunks,
                        "video_frames": length, "chunk_frames": 3, "steps": 4},
              "settings": {"repeats": args.repeats, "cache": "FAST-AR's defaults", "keep_latent": False,
                           "decoders": {"wan": "the Wan 2.1 VAE at its real widths, random weights",
                                        "taehv": "a TAEHV-family decoder at taew2_1's layout, random weights, "
                                                 "float16"}},
              "summary": summary, "ratios": ratios, "rounds": rounds}
    print(f"{'':16s}{'frames/s':>10s}{'s':>9s}{'sampler ms':>12s}")
    for key, row in summary.items():
        print(f"{key:16s}{row['fps']:10.2f}{row['seconds']:9.2f}{row['chunk_ms']:12.1f}")
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}x")
    path = write_json(args.out, "stream_bench" + ("_smoke" if args.smoke else "") + ".json", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
