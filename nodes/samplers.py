"""The two samplers of a FAST-AR rollout on a ComfyUI MODEL: ``sample`` runs it the way KSampler runs a
sampler (the Autoregressive Long Sampler's: conditioning through the model's ``extra_conds``, ComfyUI's
model management, the model's latent format); ``ARVideoSampler`` runs it as the SAMPLER of core
ComfyUI's autoregressive video graph. Both take the cache and sparse attention from the model
(``settings.settings_of``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.samplers

from ..fastar import FastARError, FlowMatchSchedule
from ..fastar.frames import chunked_lengths, whole_chunks
from .engines import Engine, engine_rollout
from .patching import is_patched, patch_model, transformer_options
from .progress import ChunkProgress
from .prompts import conditioning_context, prompt_contexts, text_context
from .settings import settings_of
from .stream import ChunkStream, StreamSettings
from .wan import check_sampling, warn_if_not_causal


@dataclass(frozen=True)
class SampleSettings:
    """The Long Sampler's own inputs (FAST-AR's settings travel on the model)."""
    width: int
    height: int
    frames: int                 # latent frames (a last chunk that is not whole is generated whole, then cut)
    batch_size: int = 1
    seed: int = 0
    timesteps: str = "1000,750,500,250"
    shift: float = 5.0
    chunk_frames: int = 3
    context_noise: float = 0.0
    cfg: float = 1.0
    prompts: list | None = None  # FAST-AR Prompt Schedule's [(start video frame, CONDITIONING)]; None: positive
    start: torch.Tensor | None = None  # a start image's latent (VAE space, ``encode_start_image``): image-to-video
    model_file: str | None = None  # the file the graph's Load Diffusion Model read (``wan.graph_model_file``)

    @property
    def first_frame(self) -> int:
        """Latent frames before the first chunk: the start image's."""
        return 0 if self.start is None else self.start.shape[2]

    @property
    def chunks(self) -> int:
        """Chunks the rollout generates (a last one that is not whole counts whole)."""
        return whole_chunks(self.frames - self.first_frame, self.chunk_frames)

    @property
    def generated_frames(self) -> int:
        """Latent frames the rollout generates: the start image's and whole chunks, cut to ``frames`` after."""
        return self.first_frame + self.chunks * self.chunk_frames


def encode_start_image(vae, image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """A start image's latent [1, C, 1, h, w], as core's AR Video I2V makes it: the first image, resized to
    the video's size (bilinear, centre crop) and encoded by the VAE."""
    import comfy.utils

    with torch.no_grad():
        image = comfy.utils.common_upscale(image[:1].movedim(-1, 1), width, height, "bilinear", "center")
        return vae.encode(image.movedim(1, -1)[:, :, :, :3])


def sample(model, positive, negative, settings: SampleSettings, on_chunk: Callable | None = None,
           preview: bool = True, on_engine: Callable[[Engine], None] | None = None,
           node: str = "Autoregressive Long Sampler", stream: ChunkStream | None = None) -> dict:
    """Run a FAST-AR rollout on a ComfyUI MODEL with the cache and sparse attention FAST-AR Patch Model put
    on it (patched here with the defaults where it was not); returns a LATENT dict (samples in the VAE's space).
    ``stream`` gets the video's latents (the VAE's space) as they come, the start image's first; with
    ``keep_latent`` off the LATENT is then the last chunk's frames only.

    Runs under ``torch.inference_mode()`` however it is called (ComfyUI's executor does the same):
    a rollout never needs autograd, and with it on every chunk's activations would be kept."""
    with torch.inference_mode():
        return _sample(model, positive, negative, settings, on_chunk, preview, on_engine, node, stream)


def _sample(model, positive, negative, settings, on_chunk, preview, on_engine, node, stream) -> dict:
    if not is_patched(model):
        model = patch_model(model)
    schedule = FlowMatchSchedule.parse(settings.timesteps, shift=settings.shift)
    device = model.load_device
    guided = settings.cfg != 1.0
    if guided and negative is None:
        raise FastARError(f"{node}: cfg={settings.cfg} needs a negative prompt; connect one or set cfg to 1")
    fastar = settings_of(model)
    fastar.check(settings.chunk_frames, node)
    check_sampling(model, settings.chunk_frames, node, "frames_per_chunk", schedule, settings.model_file)
    warn_if_not_causal(model, node)
    first, whole = settings.first_frame, settings.generated_frames
    latent_shape = (settings.batch_size, model.model.latent_format.latent_channels, whole,
                    settings.height // 8, settings.width // 8)
    noise_like = torch.zeros(()).expand(latent_shape)  # the conditioning reads its shape only: no memory
    conds = {"positive": comfy.sampler_helpers.convert_cond(positive)}
    if guided:
        conds["negative"] = comfy.sampler_helpers.convert_cond(negative)

    model_options = comfy.model_patcher.create_model_options_clone(model.model_options)
    comfy.sampler_helpers.prepare_model_patcher(model, conds, model_options)
    real_model, _, loaded = comfy.sampler_helpers.prepare_sampling(model, latent_shape, conds, model_options)
    rollout = None
    try:
        model.pre_run()
        texts = prompt_contexts(model, settings.prompts, positive, negative if guided else None,
                                lambda c, name: conditioning_context(model, c, noise_like, device, node, name),
                                noise_like, device, whole, settings.chunk_frames, node, first)
        start = None
        if settings.start is not None:  # the model's latent space, every video of the batch
            start = real_model.process_latent_in(settings.start.to(device, torch.float32))
            start = start.expand(settings.batch_size, -1, -1, -1, -1)
        rollout = engine_rollout(model, transformer_options(model, model_options, prepared=True), model_options,
                                 texts, device, node, on_engine, fastar, frames=whole, height=settings.height,
                                 width=settings.width, chunk_frames=settings.chunk_frames, schedule=schedule,
                                 seed=settings.seed, context_noise=settings.context_noise, cfg=settings.cfg,
                                 start=start)
        progress = ChunkProgress(model, rollout.num_chunks, preview)
        if stream is not None and settings.start is not None:
            stream(settings.start)

        def report(r):
            if stream is not None:  # the chunk's frames, cut to the video's length
                first = r.frames_done - r.latent.shape[2]
                if settings.frames > first:
                    stream(real_model.process_latent_out(r.latent[:, :, :settings.frames - first].float()))
            progress(r, None if stream is None else stream.latest)
            if on_chunk is not None:
                on_chunk(r)
            # Cancel from the UI: stop here, between chunks; the finally below frees the cache.
            comfy.model_management.throw_exception_if_processing_interrupted()

        keep = stream is None or stream.keep_latent
        samples = rollout.run(report, keep=keep)
        cut = settings.frames - (0 if keep else whole - samples.shape[2])  # the last chunk's frames in the video
        samples = real_model.process_latent_out(samples[:, :, :cut].to(torch.float32))
        return {"samples": samples.to(comfy.model_management.intermediate_device())}
    finally:
        del rollout
        model.cleanup()
        comfy.sampler_helpers.cleanup_models(conds, loaded)
        comfy.model_management.soft_empty_cache()


# -- core's autoregressive graph: a SAMPLER for SamplerCustom / SamplerCustomAdvanced -------------
def _graph_noise(x: torch.Tensor, seed: int, chunk_frames: int, first: int = 0) -> Callable:
    """Noise as core's ``sample_ar_video`` draws it: a chunk starts from the graph's noisy latent (its
    frames after the ``first`` a start image holds), and the re-noise after step i of chunk c comes from
    ``torch.manual_seed(seed + 1000 * c + i)``."""
    def noise(c, s, shape, device, out=None):
        if s == 0:
            n = x[:, :, first + c * chunk_frames:first + (c + 1) * chunk_frames]
        else:
            torch.manual_seed(seed + c * 1000 + s - 1)
            n = torch.randn(shape, device=device)
        if out is None:
            return n.to(device=device, dtype=torch.float32).clone()
        return out.copy_(n)
    return noise


class ARVideoSampler(comfy.samplers.Sampler):
    """FAST-AR's rollout as the SAMPLER of core's autoregressive video graph (where ``SamplerARVideo``
    sits): the graph's noise, sigmas and seed, chunks of ``chunk_frames`` latent frames, and the cache and
    sparsity of FAST-AR Patch Model's settings on the model (TempCache at its defaults without)."""

    node = "FAST-AR AR Video"

    def __init__(self, chunk_frames: int, events=None, prompts: list | None = None,
                 stream: StreamSettings | None = None):
        """``events``: gets ``sampling(frames_per_chunk, timesteps, shift, source)``, ``start(frames, chunks,
        prompts)``, ``engine(Engine)``, a ``ChunkReport`` per chunk (called) and ``finish("done" | "stopped")``
        (the cache widget's ``CacheEvents``).
        ``prompts``: a FAST-AR Prompt Schedule, which then conditions the video instead of the graph's
        positive. ``stream``: a FAST-AR Video Stream, which gets every chunk decoded as it comes (the
        whole latent is still returned: the graph decodes it)."""
        self.chunk_frames, self.events, self.prompts = int(chunk_frames), events, prompts
        self.stream = stream

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        with torch.inference_mode():
            try:
                out = self._sample(model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask)
            except BaseException:
                if self.events is not None:
                    self.events.finish("stopped")
                raise
        if self.events is not None:
            self.events.finish("done")
        return out

    def _check(self, sigmas, noise, denoise_mask, first: int) -> list[float]:
        node = self.node
        if noise.ndim != 5:
            raise FastARError(f"{node}: the latent must be a video latent [B, C, T, H, W] (Empty AR Video Latent), "
                              f"got {list(noise.shape)}")
        if denoise_mask is not None:
            raise FastARError(f"{node}: a latent noise mask is not supported by the autoregressive sampler")
        s = [float(v) for v in sigmas]
        if len(s) < 2 or s[-1] != 0.0 or any(a <= b for a, b in zip(s, s[1:])) or s[0] > 1.0:
            raise FastARError(f"{node}: sigmas must fall strictly from at most 1 to 0 (a full denoise), got "
                              f"{[round(v, 4) for v in s]}")
        frames = noise.shape[2]
        if not 0 <= first <= self.chunk_frames or (frames - first) % self.chunk_frames or frames <= first:
            lengths = " or ".join(map(str, chunked_lengths(frames, self.chunk_frames, first)))
            if first:
                raise FastARError(f"{node}: the latent has {frames} frames, not a whole number of blocks of "
                                  f"num_frame_per_block {self.chunk_frames} after AR Video I2V's start image "
                                  f"({first} latent frame{'s' if first > 1 else ''}); set AR Video I2V's length "
                                  f"to {lengths}")
            raise FastARError(f"{node}: the latent has {frames} frames, not a multiple of num_frame_per_block "
                              f"{self.chunk_frames}; set Empty AR Video Latent's length to {lengths}")
        return s[:-1]

    def _sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask):
        patcher, base, node = model_wrap.model_patcher, model_wrap.inner_model, self.node
        model_options = extra_args.get("model_options", {})
        options = transformer_options(patcher, model_options, prepared=True)
        initial = (options.get("ar_config") or {}).get("initial_latent")  # AR Video I2V's start image
        first = 0 if initial is None else initial.shape[2]
        steps = self._check(sigmas, noise, denoise_mask, first)
        fastar = settings_of(patcher)
        fastar.check(self.chunk_frames, node)
        check_sampling(patcher, self.chunk_frames, node, "num_frame_per_block")
        warn_if_not_causal(patcher, node)
        device, batch, seed = patcher.load_device, noise.shape[0], int(extra_args.get("seed", 0))
        if latent_image is None:
            latent_image = torch.zeros_like(noise)
        x = base.model_sampling.noise_scaling(sigmas[0], noise, latent_image, self.max_denoise(model_wrap, sigmas))
        frames, (h, w) = x.shape[2], x.shape[3:]
        cfg = float(getattr(model_wrap, "cfg", 1.0))
        negative = model_wrap.conds.get("negative") if cfg != 1.0 else None
        if not negative:  # nothing to guide with: unguided
            negative, cfg = None, 1.0
        texts = prompt_contexts(patcher, self.prompts, model_wrap.conds.get("positive"), negative,
                                lambda conds, name: text_context(conds, batch, device, node, name),
                                torch.zeros_like(noise), device, frames, self.chunk_frames, node, first)
        start = None
        if initial is not None:  # as core seeds its cache with it: in the model's latent space, every video
            start = base.process_latent_in(initial).to(device=device, dtype=torch.float32).expand(batch, -1, -1, -1, -1)
        if self.events is not None:  # the graph's sigmas are already shifted: shift 1 on them
            self.events.sampling(self.chunk_frames, [1000.0 * s for s in steps], 1.0,
                                 "as the graph says (num_frame_per_block and the sigmas, the model's shift applied)")
            self.events.start(frames, whole_chunks(frames - first, self.chunk_frames), 1 + len(texts[1]))
        rollout = engine_rollout(patcher, options, model_options, texts, device, node,
                                 None if self.events is None else self.events.engine, fastar,
                                 frames=frames, height=h * 8, width=w * 8, chunk_frames=self.chunk_frames,
                                 schedule=FlowMatchSchedule.from_sigmas(steps), seed=seed, cfg=cfg, start=start,
                                 noise=_graph_noise(x.to(device), seed, self.chunk_frames, first))
        done = torch.zeros_like(x)
        total = len(sigmas) - 1
        stream = None
        if self.stream is not None:
            stream = ChunkStream(self.stream, w * 8, h * 8, batch, node)
            if initial is not None:
                stream(initial)

        def report(r):
            start = r.frames_done - r.latent.shape[2]
            done[:, :, start:r.frames_done] = r.latent.to(done)
            if stream is not None:
                stream(base.process_latent_out(r.latent.float()))
                if self.events is not None:
                    self.events.saved(stream.filenames, stream.frames_written)
            if callback is not None:
                callback(max((r.chunk + 1) * total // r.num_chunks - 1, 0), done, done, total)
            if self.events is not None:
                self.events(r)
            comfy.model_management.throw_exception_if_processing_interrupted()

        try:
            out = rollout.run(report)
        finally:
            del rollout
            if stream is not None:
                stream.close()
        return base.model_sampling.inverse_noise_scaling(sigmas[-1], out.to(x))
