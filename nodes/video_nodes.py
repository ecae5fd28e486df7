"""FAST-AR Save Video: a video LATENT decoded and written frame by frame (``video``); FAST-AR Video Stream:
the same while the samplers run (``stream``)."""
from __future__ import annotations

import os

import comfy.model_management
import comfy.utils
from comfy_api.latest import io, ui

from ..fastar import FastARError
from . import video
from .schema import StreamType, schema
from .stream import StreamSettings


def _file_inputs() -> list:
    """The VAE, frame rate and file name inputs both nodes take, at the stream's defaults."""
    d = StreamSettings(vae=None)
    return [
        io.Vae.Input("vae", tooltip="The Wan 2.1 VAE (wan_2.1_vae.safetensors)."),
        io.Float.Input("fps", default=d.fps, min=1.0, max=120.0, step=1.0,
                       tooltip="Frames per second (Wan 2.1 generates at 16)."),
        io.String.Input("filename_prefix", default=d.filename_prefix,
                        tooltip="As Save Video's: a path under ComfyUI's output folder."),
    ]


class SaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARSaveVideo",
            display_name="FAST-AR Save Video (streaming)",
            description="Decodes a video LATENT with the Wan 2.1 VAE and writes it to a video file frame by frame: "
                        "the memory stays that of a few frames however long the video (VAE Decode + Save Video "
                        "hold every frame at once). The frames are VAE Decode's. Cancel closes the file with the "
                        "frames written so far.",
            inputs=[
                io.Latent.Input("samples", tooltip="The video latent (Autoregressive Long Sampler, SamplerCustom)."),
                *_file_inputs(),
                io.Combo.Input("format", options=list(video.FORMATS), default="mp4",
                               tooltip="mp4 (H.264) or webm (VP9); both play in the browser."),
            ],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, samples, vae, fps, filename_prefix, format) -> io.NodeOutput:
        latent = samples["samples"]
        if latent.ndim != 5:
            raise FastARError(f"{video.NODE}: samples must be a video latent [B, C, T, h, w], got "
                              f"{list(latent.shape)}")
        width, height = latent.shape[-1] * 8, latent.shape[-2] * 8
        folder, subfolder, (filename,) = video.output_files(filename_prefix, width, height, format)
        progress = comfy.utils.ProgressBar(latent.shape[0] * latent.shape[2])

        def tick(done):
            progress.update_absolute(done)
            comfy.model_management.throw_exception_if_processing_interrupted()

        video.write_video(os.path.join(folder, filename), video.decoded_frames(vae, latent, tick), fps, format)
        return io.NodeOutput(ui=ui.PreviewVideo([ui.SavedResult(filename, subfolder, io.FolderType.output)]))


class VideoStream(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = StreamSettings(vae=None)
        return schema(
            node_id="FastARVideoStream",
            display_name="FAST-AR Video Stream",
            description="Frames on disk while sampling: connect to a sampler's stream input (Autoregressive Long "
                        "Sampler, FAST-AR AR Video). Each finished chunk is decoded with the Wan 2.1 VAE and "
                        "appended to a video file in ComfyUI's output folder (one per video of the batch), which "
                        "plays what was made so far while the run goes on; a cancel closes it with those frames. "
                        "The frames are VAE Decode's.",
            inputs=[
                *_file_inputs(),
                io.Boolean.Input("keep_latent", default=d.keep_latent,
                                 tooltip="Off: the Long Sampler's LATENT holds only the last chunk, and the run's "
                                         "memory stays flat however long the video (the frames are in the file). "
                                         "FAST-AR AR Video always returns the whole latent, as its graph needs."),
            ],
            outputs=[StreamType.Output()],
        )

    @classmethod
    def execute(cls, vae, fps, filename_prefix, keep_latent) -> io.NodeOutput:
        video.chunk_decoder(vae, "FAST-AR Video Stream")  # a VAE it cannot decode with fails here, not mid-run
        return io.NodeOutput(StreamSettings(vae=vae, fps=float(fps), filename_prefix=filename_prefix,
                                            keep_latent=bool(keep_latent)))
