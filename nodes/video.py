"""Streaming decode: a LATENT through the Wan 2.1 VAE's causal decoder into a video file, frame by
frame, at a memory that does not grow with the video.

Wan's decoder is causal in time: ComfyUI's own decode already runs it one latent frame at a time,
carrying each causal convolution's last input frames (its feature cache) to the next, and only
then concatenates every frame. Here the same calls run in the same order with the same cache, and
each latent frame's 1 (the first) or 4 video frames go to the encoder as they come, so the file's
frames are the stock VAE Decode's.
"""
from __future__ import annotations

import os
from fractions import Fraction
from typing import Callable

import torch

import comfy.model_management

from ..fastar import FastARError

NODE = "FAST-AR Save Video"
# container -> (PyAV encoder, what the browser plays): ComfyUI's Save Video uses h264 in mp4
FORMATS = {"mp4": "h264", "webm": "libvpx-vp9"}


def _wan_vae(vae):
    """The Wan 2.1 VAE model inside ComfyUI's VAE, or one clear error."""
    try:
        import comfy.ldm.wan.vae as wan_vae
    except ImportError:  # a ComfyUI without Wan
        wan_vae = None
    model = getattr(vae, "first_stage_model", None)
    if wan_vae is None or type(model) is not wan_vae.WanVAE:
        raise FastARError(f"{NODE}: the VAE is {type(model).__name__}, not Wan 2.1's; load wan_2.1_vae.safetensors "
                          f"with Load VAE")
    return model, wan_vae.count_conv3d


def _av():
    try:
        import av
    except ImportError:
        raise FastARError(f"{NODE} writes with PyAV, which this Python lacks: pip install av "
                          f"(ComfyUI's requirements include it)") from None
    return av


def decoded_frames(vae, samples: torch.Tensor, on_latent_frame: Callable[[int], None] | None = None):
    """Yield the decoded video frames [H, W, 3] (float in [0, 1], on the CPU) of ``samples``
    [B, 16, T, h, w], video by video, as ComfyUI's VAE Decode computes them."""
    model, count_conv3d = _wan_vae(vae)
    if samples.ndim != 5 or samples.shape[1] != vae.latent_channels:
        raise FastARError(f"{NODE}: samples must be a Wan video latent [B, {vae.latent_channels}, T, h, w], "
                          f"got {list(samples.shape)}")
    comfy.model_management.load_models_gpu([vae.patcher], memory_required=vae.memory_used_decode(
        (1, samples.shape[1], 1, *samples.shape[3:]), vae.vae_dtype))
    with torch.inference_mode():
        for b in range(samples.shape[0]):
            z = samples[b:b + 1].to(vae.vae_dtype).to(vae.device)
            x = model.conv2(z)
            cache = [None] * count_conv3d(model.decoder)
            for i in range(z.shape[2]):
                out = model.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0])
                out = vae.process_output(out.to(vae.output_device).float())
                for t in range(out.shape[2]):
                    yield out[0, :, t].movedim(0, -1)
                if on_latent_frame is not None:
                    on_latent_frame(b * z.shape[2] + i + 1)


def write_video(path: str, frames, fps: float, container: str = "mp4") -> int:
    """Encode ``frames`` ([H, W, 3] floats in [0, 1]) into ``path`` as they come, as ComfyUI's Save
    Video quantizes them; returns the frame count. If the frames stop with an error (a cancel), the
    file is closed with what was written, a shorter but playable video, and the error goes on."""
    av = _av()
    if container not in FORMATS:
        raise FastARError(f"{NODE}: format {container!r} is not one of {', '.join(FORMATS)}")
    count = 0
    try:
        with av.open(path, mode="w", format=container) as output:
            stream = None
            try:
                for frame in frames:
                    img = (frame * 255).clamp(0, 255).byte().cpu().numpy()
                    if stream is None:
                        stream = output.add_stream(FORMATS[container], rate=Fraction(round(fps * 1000), 1000))
                        stream.height, stream.width = img.shape[:2]
                        stream.pix_fmt = "yuv420p"
                        if container == "webm":  # constant quality, at a speed that keeps up with long videos
                            stream.options = {"crf": "30", "b": "0", "row-mt": "1", "deadline": "realtime",
                                              "cpu-used": "8"}
                    frame = av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p")
                    output.mux(stream.encode(frame))
                    count += 1
            finally:
                if stream is not None:
                    output.mux(stream.encode(None))  # flush: the frames written so far play
    finally:
        if count == 0 and os.path.exists(path):
            os.remove(path)  # nothing to play
    return count
