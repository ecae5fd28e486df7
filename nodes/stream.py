"""Frames on disk while sampling: each finished chunk decoded by the Wan VAE or a fast decoder (the
decoder's memory of past frames carried from chunk to chunk, ``video.chunk_decoder``) and appended to a
video file per video of the batch (``video.VideoWriter``), so a long run can be watched, and kept after a
cancel, while it goes on. The decode and the writing run beside the sampling (``handoff.Handoff``): chunk k
is written while chunk k + 1 samples."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import video
from ..fastar.handoff import Handoff


@dataclass(frozen=True)
class StreamSettings:
    """FAST-AR Video Stream's inputs, which the samplers take."""
    vae: object
    fps: float = 16.0
    filename_prefix: str = "video/FastAR"
    format: str = "mp4"
    keep_latent: bool = True  # False: the Long Sampler's LATENT holds the last chunk only, and the run's memory
    #                           does not grow with the video


class ChunkStream:
    """Decodes a rollout's chunks as they come and appends their frames to the files, in a worker beside the
    sampling (``frames_written`` and ``latest`` trail by up to two chunks, the one waiting and the one at work);
    ``close`` waits for the last chunk, ends the files (also after a cancel: what was written plays) and
    returns them as ComfyUI's saved results."""

    def __init__(self, settings: StreamSettings, width: int, height: int, batch: int, node: str):
        self.node, self.frames_written, self.latest = node, 0, None
        self.keep_latent = settings.keep_latent
        folder, self.subfolder, self.filenames = video.output_files(settings.filename_prefix, width, height,
                                                                    settings.format, batch)
        self.decode = video.chunk_decoder(settings.vae, node)
        self.handoff = Handoff(self._write, getattr(settings.vae, "device", None), name="fastar-video-stream")
        self.chunks = 0
        self.writers = []
        try:
            for filename in self.filenames:
                self.writers.append(video.VideoWriter(os.path.join(folder, filename), settings.fps, settings.format,
                                                      node))
        except BaseException:
            self.close()
            raise

    def __call__(self, latents: torch.Tensor) -> None:
        """Append ``latents`` [B, C, t, h, w] (the VAE's space, the video's next t latent frames)."""
        self.handoff.put(latents.clone())
        self.chunks += 1
        if self.chunks == 1:
            self.handoff.drain()  # the first decode loads the VAE through ComfyUI: nothing else runs meanwhile

    def _write(self, latents: torch.Tensor) -> None:
        for frames in self.decode(latents):
            for writer, frame in zip(self.writers, frames):
                writer.write(frame)
            self.frames_written += 1
            self.latest = frames[0]

    def close(self, raising: bool = True) -> list:
        try:
            self.handoff.close(raising)
        finally:
            for writer in self.writers:
                writer.close()
        return [(f, self.subfolder) for f, w in zip(self.filenames, self.writers) if w.count]
