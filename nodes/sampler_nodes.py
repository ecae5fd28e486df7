"""The sampler nodes: Autoregressive Long Sampler (a whole rollout to a LATENT) and FAST-AR AR Video
(the rollout as a SAMPLER for core's autoregressive video graph), and FAST-AR Start Image (the Long
Sampler's image-to-video input)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from comfy_api.latest import io, ui

from ..fastar import FastARError, FlowMatchSchedule
from ..fastar.frames import is_video_length, latent_frames, nearest_video_lengths
from .patching import is_patched, patch_model
from .progress import CacheEvents
from .samplers import ARVideoSampler, SampleSettings, encode_start_image, sample
from .schema import (MAX_LENGTH, StartType, check_pixels, check_widget, graph_prompt, node_id, prompts_input, schema,
                     stream_input)
from .stream import ChunkStream
from .wan import graph_model_file, recorded_sampling, unrecorded_reason
from .words import in_words

FRAMES_PER_CHUNK = ("3", "1")


def _check_length(length: int) -> int:
    """Latent frames of a video ``length`` (1 + 4k frames), or one clear error."""
    if not 1 <= length <= MAX_LENGTH:
        raise FastARError(f"length {length} must lie in [1, {MAX_LENGTH}] video frames")
    if not is_video_length(length):
        lo, hi = nearest_video_lengths(length)
        raise FastARError(f"length {length} is not 1 + 4k video frames (what Wan's VAE decodes to); use {lo} or {hi}")
    return latent_frames(length)


def _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk, context_noise, cfg,
              prompts, start=None) -> SampleSettings:
    """Validated rollout settings (raises FastARError with one clear line)."""
    if str(frames_per_chunk) not in FRAMES_PER_CHUNK:
        raise FastARError(f"frames_per_chunk {frames_per_chunk!r} is not one of {', '.join(FRAMES_PER_CHUNK)}")
    chunk = int(frames_per_chunk)
    frames = _check_length(int(length))
    FlowMatchSchedule.parse(timesteps, shift=float(shift))
    check_pixels(width, height)
    return SampleSettings(width=int(width), height=int(height), frames=frames, batch_size=int(batch_size),
                          seed=int(seed), timesteps=timesteps, shift=float(shift), chunk_frames=chunk,
                          context_noise=float(context_noise), cfg=float(cfg), prompts=prompts, start=start)


class AutoregressiveLongSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARAutoregressiveSampler",
            display_name="Autoregressive Long Sampler",
            description="Generates a video latent chunk by chunk with a causal Wan 2.1 model (Self-Forcing "
                        "sampler: a few flow-matching steps per chunk, then a clean pass that writes the chunk "
                        "into the KV cache). Decode the LATENT with the stock VAE Decode, or connect a FAST-AR "
                        "Video Stream to have the video on disk while it is made.",
            inputs=[
                io.Model.Input("model", tooltip="A causal Wan 2.1 T2V model, through FAST-AR Patch Model for its "
                                                "cache and sparse attention (without: TempCache at its defaults, "
                                                "dense attention)."),
                io.Conditioning.Input("positive", tooltip="The prompt (one text conditioning)."),
                io.Int.Input("width", default=832, min=16, max=4096, step=16, tooltip="Pixels; a multiple of 16."),
                io.Int.Input("height", default=480, min=16, max=4096, step=16, tooltip="Pixels; a multiple of 16."),
                io.Int.Input("length", default=81, min=1, max=MAX_LENGTH, step=4,
                             tooltip="Video frames (1 + 4k: 81 frames = 21 latent frames). A last chunk that "
                                     "is not whole is generated whole and cut to this length."),
                io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="Videos generated together."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise of chunk c is seeded by (seed, c): a longer video shares the frames "
                                     "of a shorter one."),
                io.String.Input("timesteps", default="1000,750,500,250",
                                tooltip="Denoising steps per chunk on the 1000-step grid, strictly decreasing "
                                        "(the few-step schedule the causal checkpoints are distilled for)."),
                io.Float.Input("shift", default=5.0, min=0.01, max=100.0, step=0.01,
                               tooltip="Timestep shift that warps the listed steps (Self-Forcing uses 5)."),
                io.Combo.Input("frames_per_chunk", options=list(FRAMES_PER_CHUNK), default="3",
                               tooltip="Latent frames per chunk; must match the checkpoint (chunkwise models 3, "
                                       "framewise 1)."),
                io.Float.Input("context_noise", default=0.0, min=0.0, max=999.0, step=1.0,
                               tooltip="Timestep of the clean pass that writes a chunk into the cache (0: clean)."),
                io.Float.Input("cfg", default=1.0, min=1.0, max=30.0, step=0.1,
                               tooltip="Classifier-free guidance. The distilled causal models use none (1.0); "
                                       "above 1 a negative prompt is needed and each forward runs twice the batch."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Negative prompt, used only when cfg > 1."),
                prompts_input("positive"),
                StartType.Input("start", optional=True,
                                tooltip="Image-to-video: a FAST-AR Start Image, the video's first frame (resized to "
                                        "width x height), encoded and cached before the first chunk, as core's AR "
                                        "Video I2V does."),
                stream_input(),
                io.Boolean.Input("checkpoint_sampling", default=True, optional=True,
                                 tooltip="Where the model's file (the graph's Load Diffusion Model) records how it "
                                         "samples (fastar convert --preset writes it), take frames_per_chunk, "
                                         "timesteps and shift from it; the cache widget says which ran. Off: these "
                                         "widgets, a block size other than the file's refused."),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
            is_output_node=True,  # with a stream its file is the output, with nothing after the LATENT
        )

    @classmethod
    def validate_inputs(cls, timesteps):
        """The one free-text input, refused at /prompt in the node's words. ComfyUI puts this message on
        every input the function reads, so it reads this one only: the numbers keep ComfyUI's own min /
        max (the page rounds them to their step: 16 pixels, 1 + 4k frames), and the image's VAE is a
        required input of FAST-AR Start Image. A value the page cannot send (a script's width of 100) is
        refused when the node runs, in the same words."""
        try:
            FlowMatchSchedule.parse(str(timesteps))
        except FastARError as exc:
            return f"Autoregressive Long Sampler: {exc}"
        return True

    @classmethod
    def execute(cls, model, positive, width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                context_noise, cfg, negative=None, prompts=None, start=None, stream=None,
                checkpoint_sampling=True) -> io.NodeOutput:
        with in_words("Autoregressive Long Sampler"):  # the widgets first: a script can send what the page cannot
            settings = _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                                 context_noise, cfg, prompts)
        if not is_patched(model):  # FAST-AR's defaults; a model that is no Wan fails here, in Patch Model's words
            model = patch_model(model)
        model_file = graph_model_file(graph_prompt(cls), node_id(cls))
        settings = replace(settings, model_file=model_file)
        recorded = recorded_sampling(model, model_file) if checkpoint_sampling else None
        if recorded is not None:
            name, sampling = recorded
            settings = replace(settings, chunk_frames=sampling.frames_per_block, shift=sampling.shift,
                               timesteps=",".join(f"{t:g}" for t in sampling.timesteps))
            logging.info("Autoregressive Long Sampler: sampling as %s records (%s), not as the widgets say "
                         "(checkpoint_sampling)", name, sampling.describe())
            source = f"as {name} records (checkpoint_sampling), not the widgets"
        elif not checkpoint_sampling:
            source = "as the widgets say (checkpoint_sampling off)"
        else:
            source = "as the widgets say: " + unrecorded_reason(model, model_file)
        if start is not None:
            if settings.frames <= 1:
                raise FastARError(f"Autoregressive Long Sampler: length {length} holds only the start image; make "
                                  f"it at least 5 video frames")
            settings = replace(settings, start=encode_start_image(start.vae, start.image, settings.width,
                                                                  settings.height))
        events = CacheEvents(node_id(cls))
        events.sampling(settings.chunk_frames, FlowMatchSchedule.parse(settings.timesteps).timesteps, settings.shift,
                        source)
        events.start(settings.generated_frames, settings.chunks, len(prompts) if prompts else 1, length=int(length))
        on_chunk, chunks = events, None
        try:
            if stream is not None:
                chunks = ChunkStream(stream, settings.width, settings.height, settings.batch_size,
                                     "Autoregressive Long Sampler")

                def on_chunk(r):
                    events.saved(chunks.filenames, chunks.frames_written)
                    events(r)
            latent = sample(model, positive, negative, settings, on_chunk=on_chunk, on_engine=events.engine,
                            stream=chunks)
        except BaseException:
            events.finish("stopped")
            raise
        finally:
            saved = [] if chunks is None else chunks.close()  # after a cancel too: the frames so far play
        events.finish("done")
        if not saved:
            return io.NodeOutput(latent)
        return io.NodeOutput(latent, ui=ui.PreviewVideo([ui.SavedResult(f, sub, io.FolderType.output)
                                                         for f, sub in saved]))


@dataclass(frozen=True)
class StartImage:
    """FAST-AR Start Image's output: the image and the VAE the sampler encodes it with, at its own size."""
    image: object
    vae: object


class StartImageNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARStartImage",
            display_name="FAST-AR Start Image",
            description="Image-to-video for the Autoregressive Long Sampler: the video's first frame and the Wan "
                        "VAE that encodes it. The sampler resizes it to its width x height (bilinear, centre crop), "
                        "encodes it and caches it before the first chunk, as core's AR Video I2V does.",
            inputs=[io.Image.Input("image", tooltip="The first frame (the first image of a batch)."),
                    io.Vae.Input("vae", tooltip="The Wan 2.1 VAE (wan_2.1_vae.safetensors).")],
            outputs=[StartType.Output()],
        )

    @classmethod
    def execute(cls, image, vae) -> io.NodeOutput:
        return io.NodeOutput(StartImage(image, vae))


class ARVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARARVideo",
            display_name="FAST-AR AR Video",
            description="FAST-AR's autoregressive sampler as a SAMPLER for SamplerCustom / SamplerCustomAdvanced: "
                        "put it where Sampler AR Video sits in ComfyUI's autoregressive video graph (Empty AR "
                        "Video Latent, the graph's sigmas and seed). The KV cache and sparse attention are FAST-AR "
                        "Patch Model's (TempCache at its defaults when the model has none): bounded, instead of a "
                        "cache that grows with the video.",
            inputs=[
                io.Int.Input("num_frame_per_block", default=1, min=1, max=64,
                             tooltip="Latent frames per autoregressive block (chunk): 1 = framewise (Causal-Forcing "
                                     "framewise), 3 = chunkwise (Self-Forcing, CausVid); the checkpoint's own. "
                                     "Other sizes are refused."),
                prompts_input("SamplerCustom's positive"),
                stream_input(),
            ],
            outputs=[io.Sampler.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, num_frame_per_block):
        """Block sizes the causal Wan 2.1 checkpoints are trained with, refused by /prompt otherwise
        (ComfyUI skips its own min / max for the input read here: checked here too). The block size a
        converted file records is checked when the sampler runs (``wan.check_sampling``), where ComfyUI
        names the file on the model (2026 on): this node's SAMPLER outlives a change of model file in
        ComfyUI's cache, so it cannot take the name from the graph as the Long Sampler does."""
        try:
            check_widget(cls, "num_frame_per_block", num_frame_per_block)
            if str(num_frame_per_block) not in FRAMES_PER_CHUNK:
                raise FastARError(f"num_frame_per_block {num_frame_per_block} is not a block size a causal Wan 2.1 "
                                  f"checkpoint is trained with: 1 (framewise: Causal-Forcing framewise) or 3 "
                                  f"(chunkwise: Self-Forcing, CausVid, Causal-Forcing chunkwise); use the "
                                  f"checkpoint's own")
        except FastARError as exc:
            return f"FAST-AR AR Video: {exc}"
        return True

    @classmethod
    def execute(cls, num_frame_per_block, prompts=None, stream=None) -> io.NodeOutput:
        return io.NodeOutput(ARVideoSampler(int(num_frame_per_block), events=CacheEvents(node_id(cls)),
                                            prompts=prompts, stream=stream))

