"""Peak RAM of writing a rollout's latent to a video file, by length: FAST-AR Save Video (streaming)
beside ComfyUI's VAE Decode + Create Video + Save Video path, on the CPU, through ComfyUI's own VAE
class and Wan 2.1's VAE architecture (random weights, a narrow width so 2880 frames decode in
minutes; the frames' memory is the size's, not the width's). With ``--paths sampler_stream,sampler_latent``:
the whole run instead, the Autoregressive Long Sampler on the tiny random Wan model (TempCache 4, sink 1,
chunks of 3) with a FAST-AR Video Stream writing the file as it samples, its LATENT not kept
(``sampler_stream``) and kept (``sampler_latent``).

Each (path, length) runs in a fresh process, in torch.inference_mode() as ComfyUI's executor runs
nodes: the peak of the C heap's live bytes (glibc mallinfo2) while the path runs, minus the bytes
live just before it (the model and the latent already loaded), sampled every 2 ms; the peak RSS
above its baseline beside it (RSS also counts freed memory the allocator keeps, and moves with
it). Wall times are printed for orientation only.

    COMFYUI_PATH=... python bench/stream_memory.py --out bench/results
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import header, parser, write_json  # noqa: E402

LENGTHS = (61, 601, 2881)  # video frames (1 + 4k): about 60, 600 and 2880
PATHS = ("streaming", "stock", "sampler_stream", "sampler_latent")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    """Bytes the C heap holds live (glibc mallinfo2: allocated chunks plus mmapped blocks): what
    tensors, the codec's buffers and the decoder's scratch take, free of allocator fragmentation."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def child(path: str, length: int, size: int, dim: int, work: str) -> dict:
    from fractions import Fraction

    import torch

    from common.comfyui import harness

    harness.import_comfy(os.environ["COMFYUI_PATH"], cpu=True)
    import comfy.ldm.wan.vae
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils
    from comfy_api.latest import VideoComponents, VideoFromComponents

    from comfyui_fastar.nodes import video

    weights = Path(work) / "wan_vae.safetensors"
    if not weights.exists():  # written by the first child, read by every one
        harness.wan_vae_file(weights)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(weights)))
    torch.manual_seed(0)
    small = comfy.ldm.wan.vae.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                     temperal_downsample=[False, True, True])
    for name, p in small.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("gamma") else torch.nn.init.normal_(p, std=p[0].numel() ** -0.5)
    small.eval().requires_grad_(False)
    vae.first_stage_model = small  # the same ComfyUI VAE object, narrower
    vae.patcher = comfy.model_patcher.ModelPatcher(small, load_device=vae.device, offload_device=vae.patcher.offload_device)
    latent = torch.randn(1, 16, (length - 1) // 4 + 1, size // 8, size // 8)
    out = str(Path(work) / f"{path}_{length}.mp4")
    if path.startswith("sampler"):
        run = sampler_run(path, length, size, vae, work, out)

    def run_path():
        if path.startswith("sampler"):
            return run()
        if path == "streaming":
            return video.write_video(out, video.decoded_frames(vae, latent), 16.0, "mp4")
        images = vae.decode(latent)  # VAE Decode
        images = images.reshape(-1, *images.shape[-3:])
        VideoFromComponents(VideoComponents(images=images, frame_rate=Fraction(16))).save_to(out)  # Save Video
        return images.shape[0]

    _libc.malloc_trim(0)  # hand freed heap back, so the RSS baseline holds only live memory
    base, peak, done = (heap_bytes(), rss_bytes()), [0, 0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0], peak[1] = max(peak[0], heap_bytes()), max(peak[1], rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    tic = time.perf_counter()
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        frames = run_path()
    seconds = time.perf_counter() - tic
    done.set()
    sampler.join()
    return {"path": path, "length": length, "frames_written": frames, "seconds": round(seconds, 2),
            "peak_mb": round((max(peak[0], heap_bytes()) - base[0]) / 2**20, 1),
            "rss_peak_mb": round((max(peak[1], rss_bytes()) - base[1]) / 2**20, 1),
            "file_mb": round(os.path.getsize(out) / 2**20, 2)}


def sampler_run(path: str, length: int, size: int, vae, work: str, out: str):
    """The Long Sampler with a Video Stream on the tiny model, ready to run: returns ``run() -> frames written``."""
    import glob

    import comfy.sd
    import torch

    from common.comfyui import harness
    try:
        import folder_paths
    except ImportError:
        from comfy.cmd import folder_paths

    from comfyui_fastar.fastar import TempCacheConfig
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.settings_nodes import PatchModel
    from comfyui_fastar.nodes.stream import StreamSettings

    weights = Path(work) / "wan_tiny.safetensors"
    if not weights.exists():
        harness.write_wan(harness.tiny_wan(), work, "wan_tiny")
    model = comfy.sd.load_diffusion_model(str(weights), model_options={"dtype": torch.float32})
    model = PatchModel.execute(model, TempCacheConfig(max_cache_frames=4, sink_frames=1)).result[0]
    folder_paths.get_output_directory = lambda: work
    prefix = f"{path}_{length}"
    stream = StreamSettings(vae=vae, filename_prefix=prefix, keep_latent=path == "sampler_latent")
    positive = [[harness.prompt(1), {}]]

    def run():
        AutoregressiveLongSampler.execute(model, positive, size, size, length, 1, 3, "1000,750,500,250", 5.0, "3",
                                          0.0, 1.0, stream=stream)
        (written,) = glob.glob(os.path.join(work, f"{prefix}_*.mp4"))
        os.replace(written, out)
        return len(harness.read_video(out)[0])
    return run


def gpu_rows(args) -> list[dict]:
    """``--on-cuda``: the Long Sampler + Video Stream at 832x480 on the GPU, each length after the other."""
    import glob

    import torch

    from common import testbed
    from common.comfyui import harness, load_unet

    comfy = harness.import_comfy(args.comfyui, cpu=False)
    import comfy.cmd.folder_paths as folder_paths
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.stream import StreamSettings

    work = tempfile.mkdtemp(prefix="fastar_stream_gpu_")
    model, context = testbed.testbed(prompt="wan")
    harness.write_wan(model, work, "testbed", torch.bfloat16)
    del model
    folder_paths.add_model_folder_path("diffusion_models", work)
    folder_paths.get_output_directory = lambda: work
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(harness.wan_vae_file(Path(work) / "vae.safetensors"))))
    positive = [[context.float().cpu(), {}]]
    height, width = testbed.HEIGHT, testbed.WIDTH
    rows = []
    with torch.inference_mode():
        unet = load_unet(comfy, "testbed.safetensors", None)
        comfy.model_management.load_models_gpu([unet])  # the weights in place before any baseline is read
        AutoregressiveLongSampler.execute(unet, positive, width, height, 9, 1, 0, "1000,750,500,250", 5.0, "3",
                                          0.0, 1.0, stream=StreamSettings(vae=vae, filename_prefix="warmup"))
        for path in args.paths.split(","):
            for length in map(int, args.lengths.split(",")):
                prefix = f"{path}_{length}"
                stream = StreamSettings(vae=vae, filename_prefix=prefix, keep_latent=path == "sampler_latent")
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                tic = time.perf_counter()
                AutoregressiveLongSampler.execute(unet, positive, width, height, length, 1, 0, "1000,750,500,250",
                                                  5.0, "3", 0.0, 1.0, stream=stream)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - tic
                (written,) = glob.glob(os.path.join(work, f"{prefix}_*.mp4"))
                rows.append({"path": path, "length": length, "frames_written": len(harness.read_video(written)[0]),
                             "seconds": round(seconds, 1),
                             "peak_mb": round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
                             "loaded_mb": round(base / 2**20, 1), "file_mb": round(os.path.getsize(written) / 2**20, 2)})
                print(f"{path:15s} {length:5d} frames: GPU peak +{rows[-1]['peak_mb']:8.1f} MB above "
                      f"{rows[-1]['loaded_mb']:.0f} MB loaded, {rows[-1]['frames_written']} frames written, "
                      f"{seconds:6.1f} s", flush=True)
                os.remove(written)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, label in (("stock", "VAE Decode + Save Video"), ("streaming", "FAST-AR Save Video (streaming)"),
                        ("sampler_stream", "Long Sampler + Video Stream, LATENT not kept"),
                        ("sampler_latent", "Long Sampler + Video Stream, LATENT kept")):
        pts = [(r["length"], r["peak_mb"]) for r in result["rows"] if r["path"] == name]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("video frames")
    ax.set_ylabel(("peak GPU memory allocated" if result.get("gpu") else "peak live heap")
                  + " above the loaded model, MB")
    ax.set_title(f"{result['device']}, {result['size']} frames, {result['vae']}", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--size", type=int, default=128, help="frame width and height in pixels (default 128)")
    p.add_argument("--dim", type=int, default=16, help="the VAE's base width (Wan 2.1's is 96; default 16)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--paths", default="streaming,stock", help=f"of {', '.join(PATHS)} (default streaming,stock)")
    p.add_argument("--tag", default="stream_memory", help="the result files' name (default stream_memory)")
    # not --gpu: ComfyUI's own argument parser, which reads sys.argv too, would take it for its --gpu-only
    p.add_argument("--on-cuda", action="store_true", help="the sampler paths on a CUDA GPU at 832x480 (needs --comfyui)")
    p.add_argument("--comfyui", help="--on-cuda: a ComfyUI tree (COMFYUI_PATH otherwise)")
    p.add_argument("--child", nargs=3, metavar=("PATH", "LENGTH", "WORK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.size, args.dim, args.child[2])))
        return
    paths = args.paths.split(",")
    if any(path not in PATHS for path in paths):
        p.error(f"--paths: choose among {', '.join(PATHS)}")
    if args.on_cuda:
        if any(not path.startswith("sampler") for path in paths):
            p.error("--on-cuda runs the sampler paths only: sampler_stream, sampler_latent")
        args.comfyui = args.comfyui or os.environ.get("COMFYUI_PATH")
        rows = gpu_rows(args)
        setup = {**header("cuda"), "gpu": True, "comfyui": args.comfyui, "size": "832x480",
                 "vae": "Wan 2.1 VAE, dim 96, random weights", "model": "Wan 2.1 1.3B shapes, sensitized random "
                 "weights (bench/common/testbed.py), bf16, FAST-AR at the pack's defaults"}
    else:
        rows = []
        with tempfile.TemporaryDirectory() as work:
            for length in map(int, args.lengths.split(",")):
                for path in paths:
                    cmd = [sys.executable, __file__, "--size", str(args.size), "--dim", str(args.dim),
                           "--child", path, str(length), work]
                    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
                    print(f"{path:9s} {length:5d} frames: heap peak +{rows[-1]['peak_mb']:8.1f} MB, "
                          f"RSS peak +{rows[-1]['rss_peak_mb']:8.1f} MB, {rows[-1]['seconds']:7.1f} s")
        setup = {**header("cpu"), "comfyui": os.environ["COMFYUI_PATH"], "size": f"{args.size}x{args.size}",
                 "vae": f"Wan 2.1 VAE architecture, dim {args.dim}, random weights"}
    first = paths[0]  # the path whose flatness is the claim
    stream = [r["peak_mb"] for r in rows if r["path"] == first]
    result = {**setup, "rows": rows, "peak_spread_path": first, "peak_spread": round(max(stream) / min(stream) - 1, 3)}
    write_json(args.out, f"{args.tag}.json", result)
    plot(result, Path(args.out) / f"{args.tag}.png")
    print(f"{first} peak spread across lengths: {result['peak_spread']:.1%}")


if __name__ == "__main__":
    main()
