"""Streaming decode: a LATENT through a video decoder into a video file, frame by frame, at a memory
that does not grow with the video. Two decoders, chosen once from the VAE (``chunk_decoder``):

- Wan 2.1's VAE: its decoder is causal in time, and ComfyUI's own decode already runs it one latent frame
  at a time, carrying each causal convolution's last input frames (its feature cache) to the next, and
  only then concatenates every frame. Here the same calls run in the same order with the same cache.
- The TAEHV family (ComfyUI's ``comfy.taesd.taehv``: lighttaew2_1, taew2_1 through FAST-AR Load Fast
  Decoder): tiny decoders whose only memory in time is each MemBlock's previous input frame. Here core's
  layers run a latent frame at a time with those frames carried from one call to the next, and the first
  frames core trims (its ``frames_to_trim``) are dropped once, at the start of the video.

Either way each latent frame's 1 (the video's first) or 4 video frames go out as they come, and they are
the frames ComfyUI's VAE Decode makes of the whole latent with the same VAE.
"""
from __future__ import annotations

import logging
import os
from fractions import Fraction
from typing import Callable, Iterator

import torch

import comfy.model_management

from ..fastar import FastARError
from ..fastar.handoff import finish
from .progress import comfy_module

NODE = "FAST-AR Save Video"
# container -> (PyAV encoder, what the browser plays): ComfyUI's Save Video uses h264 in mp4
FORMATS = {"mp4": "h264", "webm": "libvpx-vp9"}
LOAD = "load wan_2.1_vae.safetensors with Load VAE, or a fast decoder with FAST-AR Load Fast Decoder"


def _wan_vae(vae, node: str = NODE):
    """The Wan 2.1 VAE model inside ComfyUI's VAE, or one clear error (for the start image's encoding,
    which a fast decoder cannot do)."""
    try:
        import comfy.ldm.wan.vae as wan_vae
    except ImportError:  # a ComfyUI without Wan
        wan_vae = None
    model = getattr(vae, "first_stage_model", None)
    if wan_vae is None or type(model) is not wan_vae.WanVAE:
        if type(model).__name__ == "TAEHV":
            raise FastARError(f"{node}: the start image's VAE is a TAEHV fast decoder; the start image is encoded "
                              f"with Wan 2.1's VAE: connect wan_2.1_vae.safetensors (Load VAE) to FAST-AR Start Image")
        raise FastARError(f"{node}: the VAE is {type(model).__name__}, not Wan 2.1's; load wan_2.1_vae.safetensors "
                          f"with Load VAE")
    return model, wan_vae.count_conv3d


def taehv_module(node: str):
    """ComfyUI's TAEHV module (``comfy.taesd.taehv``), or one line where this ComfyUI has none."""
    try:
        import comfy.taesd.taehv as taehv
    except ImportError:
        raise FastARError(f"{node}: this ComfyUI has no TAEHV (comfy/taesd/taehv.py, in ComfyUI since late 2025): "
                          f"update ComfyUI to decode with a fast decoder, or use wan_2.1_vae.safetensors") from None
    return taehv


class ChunkDecoder:
    """A video's latent fed a chunk at a time, the decoder's memory of past frames carried from one call to
    the next: the frames are those the whole latent decodes to, and the memory that of one latent frame's.
    Call it with [B, 16, t, h, w] latents in the VAE's space; yields the video frames [B, H, W, 3] (float,
    on the CPU, as VAE Decode's): 1 for the video's first latent frame, then 4 each. ``chunk_decoder``
    picks the implementation for a VAE; each gives ``_frames`` of one latent frame on the VAE's device."""

    def __init__(self, vae, node: str):
        self.vae, self.node, self.loaded = vae, node, False

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        vae = self.vae
        if z.ndim != 5 or z.shape[1] != vae.latent_channels:
            raise FastARError(f"{self.node}: samples must be a Wan video latent [B, {vae.latent_channels}, T, h, w], "
                              f"got {list(z.shape)}")
        if not self.loaded:
            comfy.model_management.load_models_gpu([vae.patcher], memory_required=vae.memory_used_decode(
                (z.shape[0], z.shape[1], 1, *z.shape[3:]), vae.vae_dtype))
            self.loaded = True
        with torch.inference_mode():
            z = z.to(vae.vae_dtype).to(vae.device)
            for i in range(z.shape[2]):
                out = finish(lambda: vae.process_output(self._frames(z[:, :, i:i + 1]).to(vae.output_device).float()),
                             self)
                for t in range(out.shape[2]):
                    yield out[:, :, t].movedim(1, -1)

    def _frames(self, z: torch.Tensor) -> torch.Tensor:
        """One latent frame [B, 16, 1, h, w] -> its video frames [B, 3, n, H, W] before ``process_output``."""
        raise NotImplementedError

    def state(self):
        """The memory a latent frame's decode changes (it replaces entries, never writes into them)."""
        raise NotImplementedError

    def restore(self, state) -> None:
        raise NotImplementedError


class WanChunks(ChunkDecoder):
    """Wan 2.1's causal decoder, its feature cache carried."""

    def __init__(self, vae, node: str):
        super().__init__(vae, node)
        self.model, count_conv3d = _wan_vae(vae, node)
        self.cache = [None] * count_conv3d(self.model.decoder)

    def _frames(self, z):
        # conv2 is pointwise in time: a frame at a time is exact
        return self.model.decoder(self.model.conv2(z), feat_cache=self.cache, feat_idx=[0])

    def state(self):
        return list(self.cache)

    def restore(self, state) -> None:
        self.cache[:] = state


class TAEHVChunks(ChunkDecoder):
    """Core's TAEHV decoder layers, run a latent frame at a time: each MemBlock reads the input it had one
    video frame before (zeros at the video's start; across calls, the frame kept in ``memory``), a TGrow
    makes its frames out of one, and the first ``frames_to_trim`` frames of the video are dropped, as
    core's whole-video decode does."""

    def __init__(self, vae, node: str, taehv):
        super().__init__(vae, node)
        self.model, self.taehv = vae.first_stage_model, taehv
        self.memory: dict[int, torch.Tensor] = {}
        self.trim = self.model.frames_to_trim

    def _frames(self, z):
        x = self.model.process_in(z)[:, :, 0]  # [B, C, h, w]: the decoder's latent space
        batch, frames = x.shape[0], 1
        for i, layer in enumerate(self.model.decoder):
            if isinstance(layer, self.taehv.MemBlock):
                seq = x.view(batch, frames, *x.shape[1:])
                last = self.memory.get(i)
                past = torch.cat([torch.zeros_like(seq[:, :1]) if last is None else last, seq[:, :-1]], 1)
                self.memory[i] = seq[:, -1:].clone()
                x = layer(x, past.reshape(x.shape))
            else:
                x = layer(x)
                if isinstance(layer, self.taehv.TGrow):
                    frames *= layer.stride
        x = x.view(batch, frames, *x.shape[1:])
        drop, self.trim = min(self.trim, frames), self.trim - min(self.trim, frames)
        return x[:, drop:].movedim(1, 2)

    def state(self):
        return dict(self.memory), self.trim

    def restore(self, state) -> None:
        self.memory, self.trim = dict(state[0]), state[1]


def chunk_decoder(vae, node: str = NODE) -> ChunkDecoder:
    """The chunk decoder for ``vae`` (ComfyUI's VAE): Wan 2.1's, or a TAEHV-family fast decoder's; any
    other VAE is refused in one line naming ``node``'s vae input."""
    model = getattr(vae, "first_stage_model", None)
    kind = type(model).__name__
    if kind == "TAEHV":
        taehv = taehv_module(node)
        if type(model) is not taehv.TAEHV:
            raise FastARError(f"{node}: vae is a TAEHV this ComfyUI's comfy.taesd.taehv did not make")
        if model.latent_channels != 16 or model.patch_size != 1:
            raise FastARError(f"{node}: vae is a fast decoder for {model.latent_channels}-channel latents (Wan "
                              f"2.2's or another model's), not Wan 2.1's 16: load lighttaew2_1 or taew2_1")
        if model.latent_format is not None and model.latent_format.__name__ == "HunyuanVideo":
            logging.warning("%s: ComfyUI reads this fast decoder (a float16 file) as HunyuanVideo's taehv, whose "
                            "frames of Wan 2.1's latents are off: lighttaew2_1 or taew2_1 decode Wan 2.1's", node)
        return TAEHVChunks(vae, node, taehv)
    try:
        import comfy.ldm.wan.vae as wan_vae
    except ImportError:  # a ComfyUI without Wan
        wan_vae = None
    if wan_vae is None or type(model) is not wan_vae.WanVAE:
        raise FastARError(f"{node}: vae is {kind}, neither Wan 2.1's VAE nor a TAEHV fast decoder; {LOAD}")
    return WanChunks(vae, node)


def _av(node: str = NODE):
    try:
        import av
    except ImportError:
        raise FastARError(f"{node} writes with PyAV, which this Python lacks: pip install av "
                          f"(ComfyUI's requirements include it)") from None
    return av


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
    chunk_decoder(vae)
    if samples.ndim != 5 or samples.shape[1] != vae.latent_channels:
        raise FastARError(f"{NODE}: samples must be a Wan video latent [B, {vae.latent_channels}, T, h, w], "
                          f"got {list(samples.shape)}")
    for b in range(samples.shape[0]):
        decode = chunk_decoder(vae)
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
