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
from .progress import comfy_module

NODE = "FAST-AR Save Video"
# container -> (PyAV encoder, what the browser plays): ComfyUI's Save Video uses h264 in mp4
FORMATS = {"mp4": "h264", "webm": "libvpx-vp9"}


def _wan_vae(vae, node: str = NODE):
    """The Wan 2.1 VAE model inside ComfyUI's VAE, or one clear error."""
    try:
        import comfy.ldm.wan.vae as wan_vae
    except ImportError:  # a ComfyUI without Wan
        wan_vae = None
    model = getattr(vae, "first_stage_model", None)
    if wan_vae is None or type(model) is not wan_vae.WanVAE:
        raise FastARError(f"{node}: the VAE is {type(model).__name__}, not Wan 2.1's; load wan_2.1_vae.safetensors "
                          f"with Load VAE")
    return model, wan_vae.count_conv3d


def _av(node: str = NODE):
    try:
        import av
    except ImportError:
        raise FastARError(f"{node} writes with PyAV, which this Python lacks: pip install av "
                          f"(ComfyUI's requirements include it)") from None
    return av


class ChunkDecoder:
    """Wan's causal decoder fed a latent chunk at a time, its feature cache carried from one call to the
    next: the frames are those the whole latent decodes to, and the memory that of one latent frame's.
    Call it with [B, C, t, h, w] latents in the VAE's space; yields the video frames [B, H, W, 3] (float in
    [0, 1], on the CPU): 1 for the video's first latent frame, then 4 each."""

    def __init__(self, vae, node: str = NODE):
        self.model, count_conv3d = _wan_vae(vae, node)
        self.vae, self.node = vae, node
        self.cache = [None] * count_conv3d(self.model.decoder)
        self.loaded = False

    def __call__(self, z: torch.Tensor):
        vae = self.vae
        if z.ndim != 5 or z.shape[1] != vae.latent_channels:
            raise FastARError(f"{self.node}: samples must be a Wan video latent [B, {vae.latent_channels}, T, h, w], "
                              f"got {list(z.shape)}")
        if not self.loaded:
            comfy.model_management.load_models_gpu([vae.patcher], memory_required=vae.memory_used_decode(
                (z.shape[0], z.shape[1], 1, *z.shape[3:]), vae.vae_dtype))
            self.loaded = True
        with torch.inference_mode():
            x = self.model.conv2(z.to(vae.vae_dtype).to(vae.device))  # pointwise in time: chunk by chunk is exact
            for i in range(x.shape[2]):
                out = self.model.decoder(x[:, :, i:i + 1], feat_cache=self.cache, feat_idx=[0])
                out = vae.process_output(out.to(vae.output_device).float())
                for t in range(out.shape[2]):
                    yield out[:, :, t].movedim(1, -1)


def start_image_latent(vae, image: torch.Tensor, max_frames: int, node: str, tol: float = 1e-3) -> torch.Tensor:
    """The Wan VAE latent [1, 16, n, h, w] (the VAE's space) of ``image`` [1, H, W, 3] followed by black
    frames, as encoding the whole video gives it: the causal encoder fed the image, then black frames 4 at
    a time with its cache carried, until a latent frame equals the one before it (to ``tol`` of the
    largest value) or ``max_frames`` latent frames are made. Every later latent frame is then that one: the
    image's trace in the encoder's cache dies out a few frames into the black, so a long video's condition
    costs the encoding of those few."""
    model, count_conv3d = _wan_vae(vae, node)
    comfy.model_management.load_models_gpu([vae.patcher], memory_required=vae.memory_used_encode(
        (1, 3, 4, *image.shape[1:3]), vae.vae_dtype))
    cache = [None] * count_conv3d(model.encoder)
    with torch.inference_mode():
        x = vae.process_input(image[:1, :, :, :3].movedim(-1, 1)).to(vae.vae_dtype).to(vae.device)[:, :, None]
        black = torch.full_like(x, -1.0).expand(-1, -1, 4, -1, -1)  # pixel 0, in the encoder's [-1, 1]
        out = [model.conv1(model.encoder(x, feat_cache=cache, feat_idx=[0])).chunk(2, dim=1)[0]]
        while len(out) < max_frames:
            out.append(model.conv1(model.encoder(black, feat_cache=cache, feat_idx=[0])).chunk(2, dim=1)[0])
            if len(out) > 2 and (out[-1] - out[-2]).abs().max() <= tol * out[-1].abs().max():
                break
    return torch.cat(out, 2).float().to(comfy.model_management.intermediate_device())


def decoded_frames(vae, samples: torch.Tensor, on_latent_frame: Callable[[int], None] | None = None):
    """Yield the decoded video frames [H, W, 3] (float in [0, 1], on the CPU) of ``samples``
    [B, 16, T, h, w], video by video, as ComfyUI's VAE Decode computes them."""
    _wan_vae(vae)
    if samples.ndim != 5 or samples.shape[1] != vae.latent_channels:
        raise FastARError(f"{NODE}: samples must be a Wan video latent [B, {vae.latent_channels}, T, h, w], "
                          f"got {list(samples.shape)}")
    for b in range(samples.shape[0]):
        decode = ChunkDecoder(vae)
        for i in range(samples.shape[2]):
            for frame in decode(samples[b:b + 1, :, i:i + 1]):
                yield frame[0]
            if on_latent_frame is not None:
                on_latent_frame(b * samples.shape[2] + i + 1)


class VideoWriter:
    """A video file written frame by frame, as ComfyUI's Save Video quantizes frames ([H, W, 3] floats in
    [0, 1]). mp4 is fragmented, a fragment per frame flushed as it is written: the file on disk plays what
    was written so far (but the newest frame, which follows with the next or at ``close``), also after a
    crash. ``close`` ends the file (a webm plays only then); a file with no frame is removed."""

    def __init__(self, path: str, fps: float, container: str = "mp4", node: str = NODE):
        av = _av(node)
        if container not in FORMATS:
            raise FastARError(f"{node}: format {container!r} is not one of {', '.join(FORMATS)}")
        self.path, self.fps, self.container, self.count = path, fps, container, 0
        options = {"movflags": "frag_every_frame+empty_moov+default_base_moof", "flush_packets": "1"} \
            if container == "mp4" else {}
        self.output = av.open(path, mode="w", format=container, options=options)
        self.stream = None
        self._av = av

    def write(self, frame: torch.Tensor) -> None:
        img = (frame * 255).clamp(0, 255).byte().cpu().numpy()
        if self.stream is None:
            stream = self.output.add_stream(FORMATS[self.container], rate=Fraction(round(self.fps * 1000), 1000))
            stream.height, stream.width = img.shape[:2]
            stream.pix_fmt = "yuv420p"
            if self.container == "webm":  # constant quality, at a speed that keeps up with long videos
                stream.options = {"crf": "30", "b": "0", "row-mt": "1", "deadline": "realtime", "cpu-used": "8"}
            else:  # no frame held back in the encoder: each reaches the file as it is written
                stream.options = {"tune": "zerolatency"}
            self.stream = stream
        frame = self._av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p")
        self.output.mux(self.stream.encode(frame))
        self.count += 1

    def close(self) -> int:
        """Flush and end the file; returns its frame count."""
        if self.output is None:
            return self.count
        try:
            if self.stream is not None:
                self.output.mux(self.stream.encode(None))
        finally:
            self.output.close()
            self.output = None
            if self.count == 0 and os.path.exists(self.path):
                os.remove(self.path)  # nothing to play
        return self.count


def output_files(prefix: str, width: int, height: int, container: str, count: int = 1) -> tuple[str, str, list[str]]:
    """Where ``count`` new video files go, as Save Video names them: (folder, its subfolder of ComfyUI's output
    folder, the file names)."""
    folder_paths = comfy_module("folder_paths")
    folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
        prefix, folder_paths.get_output_directory(), width, height)
    return folder, subfolder, [f"{name}_{counter + i:05}_.{container}" for i in range(count)]


def write_video(path: str, frames, fps: float, container: str = "mp4") -> int:
    """Encode ``frames`` ([H, W, 3] floats in [0, 1]) into ``path`` as they come (``VideoWriter``);
    returns the frame count. If the frames stop with an error (a cancel), the file is closed with what
    was written, a shorter but playable video, and the error goes on."""
    writer = VideoWriter(path, fps, container)
    try:
        for frame in frames:
            writer.write(frame)
    finally:
        writer.close()
    return writer.count
