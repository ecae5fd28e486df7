"""The FAST-AR nodes (ComfyUI V3 schema). Glue only: inputs become ``fastar`` settings, the
bridge runs them, results go back to ComfyUI."""
from __future__ import annotations

import contextlib
import os
import time

import comfy.model_management
import comfy.utils
from comfy_api.latest import io, ui

from ..fastar import CacheConfig, FastARError, FlowMatchSchedule, TempCacheConfig, latent_frames, video_frames
from ..fastar.config import AnnConfig
from . import bridge, video

CATEGORY = "FAST-AR"
CacheType = io.Custom("FASTAR_CACHE")
AnnType = io.Custom("FASTAR_ANN")
PromptsType = io.Custom("FASTAR_PROMPTS")
SCHEDULE_SLOTS = 4
_UNCONNECTED = object()  # an optional input left unconnected (validate_inputs' default)
CACHE_EVENT = "fastar.cache"


def _schema(**fields) -> io.Schema:
    return io.Schema(category=CATEGORY, **fields)


def _prompts_input(instead_of: str):
    return PromptsType.Input("prompts", optional=True,
                             tooltip=f"A FAST-AR Prompt Schedule: prompts that change along the video, which "
                                     f"then condition it instead of {instead_of}.")


@contextlib.contextmanager
def _in_words(node: str, library: str | None = None):
    """A FastARError in the node's words: after the node's name, or, given ``library``, with the
    library's name for a setting (``TempCacheConfig.x``) made the node's (``TempCache Settings: x``)."""
    try:
        yield
    except FastARError as exc:
        message = str(exc)
        message = f"{node}: {message}" if library is None else message.replace(library, f"{node}: ", 1)
        raise FastARError(message) from None


class PatchModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(
            node_id="FastARPatchModel",
            display_name="FAST-AR Patch Model",
            description="The one place a FAST-AR graph sets its KV cache and sparse attention: the samplers "
                        "(Autoregressive Long Sampler, FAST-AR AR Video) read them from the model. Returns a copy: "
                        "the input model is untouched, and outside those samplers it samples exactly like the "
                        "stock model.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 T2V / causal (Self-Forcing, CausVid, LongLive, "
                                                "Causal-Forcing) model."),
                CacheType.Input("cache", optional=True,
                                tooltip="TempCache Settings (compressed, flat memory) or Sink + Window Cache (dense: a "
                                        "window, or every frame). Empty: TempCache at its defaults."),
                AnnType.Input("ann", optional=True,
                              tooltip="ANN Sparsity (AnnSA / AnnCA). Empty: dense attention."),
                io.Boolean.Input("fp8_linears", default=False, optional=True,
                                 tooltip="The blocks' linear layers as fp8 matmuls (fp8_e4m3fn weights as they are, "
                                         "bf16 / fp16 ones through an fp8 copy of half their size). Faster on 14B "
                                         "models, slower on 1.3B ones, at a few % of each layer's output in error; "
                                         "needs a GPU with fp8 tensor cores (RTX 40 / H100 on)."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, cache=None, ann=None, fp8_linears=False) -> io.NodeOutput:
        settings = {"cache": cache if cache is not None else TempCacheConfig(), "fp8_linears": bool(fp8_linears)}
        if ann is not None:
            settings["ann"] = ann
        bridge.check_cache(settings["cache"], ann, 1, "FAST-AR Patch Model")
        return io.NodeOutput(bridge.patch_model(model, settings, node="FAST-AR Patch Model"))


class TempCacheSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = TempCacheConfig()
        return _schema(
            node_id="FastARTempCacheSettings",
            display_name="TempCache Settings",
            description="KV-cache compression by temporal correspondence (FAST-AR TempCache): each new key finds "
                        "its nearest cached key; close pairs merge into one key with a log-count bias, which is "
                        "exact for identical keys. The cache never exceeds max cache frames.",
            inputs=[
                io.Boolean.Input("enabled", default=d.enabled,
                                 tooltip="Merge corresponding keys. Off keeps the same budget with eviction only "
                                         "(the baseline TempCache is measured against)."),
                io.Float.Input("merge_threshold", default=d.merge_threshold, min=0.01, max=1.0, step=0.01,
                               tooltip="Cosine similarity two keys need to merge. 1.0 merges only identical "
                                       "keys (exact); lower merges more and saves more memory."),
                io.Int.Input("max_cache_frames", default=d.max_cache_frames, min=2, max=4096, step=1,
                             tooltip="Token budget of the cache in latent frames (sink included). Memory stays "
                                     "flat at this size however long the video."),
                io.Int.Input("sink_frames", default=d.sink_frames, min=0, max=64, step=1,
                             tooltip="First latent frames kept as they are, never merged or evicted "
                                     "(the attention sink)."),
            ],
            outputs=[CacheType.Output()],
        )

    @classmethod
    def execute(cls, enabled, merge_threshold, max_cache_frames, sink_frames) -> io.NodeOutput:
        with _in_words("TempCache Settings", "TempCacheConfig."):
            return io.NodeOutput(TempCacheConfig(enabled=enabled, merge_threshold=float(merge_threshold),
                                                 max_cache_frames=int(max_cache_frames), sink_frames=int(sink_frames)))


class WindowCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(
            node_id="FastARWindowCache",
            display_name="Sink + Window Cache",
            description="A dense KV cache: the first sink frames and the most recent window frames (LongLive's "
                        "sink 3 + window 12; flat memory, no memory of the frames in between), or with unbounded "
                        "every frame (the dense baseline: memory and time grow with the video).",
            inputs=[
                io.Int.Input("sink_frames", default=3, min=0, max=64,
                             tooltip="First latent frames always kept (the attention sink)."),
                io.Int.Input("window_frames", default=12, min=1, max=1024,
                             tooltip="Most recent latent frames kept before the chunk."),
                io.Boolean.Input("unbounded", default=False,
                                 tooltip="Keep every frame instead (the dense baseline FAST-AR is measured against)."),
            ],
            outputs=[CacheType.Output()],
        )

    @classmethod
    def execute(cls, sink_frames, window_frames, unbounded) -> io.NodeOutput:
        return io.NodeOutput(CacheConfig("unbounded" if unbounded else "window", int(sink_frames), int(window_frames)))


class AnnSparsity(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = AnnConfig()
        return _schema(
            node_id="FastARAnnSparsity",
            display_name="ANN Sparsity",
            description="Approximate-nearest-neighbour sparse attention (FAST-AR AnnSA / AnnCA): a block of the "
                        "chunk's queries reads only the cached key blocks that score best against it (int8 "
                        "similarity to blocks of bucket-sorted keys), and, with AnnCA, each frame only the prompt "
                        "tokens that share a bucket with it. The current chunk and the sink stay dense. Needs "
                        "TempCache Settings or an unbounded cache on FAST-AR Patch Model. Off by default: it pays "
                        "only with long budgets (max cache frames 21 and more) on content whose attention spreads "
                        "over the history (then ~0.95x TempCache alone's time, at some fidelity); at the default "
                        "12 frames it is slower, and layers where it reads most keys run dense on their own.",
            inputs=[
                io.Boolean.Input("annsa", default=d.annsa,
                                 tooltip="Sparse self-attention over the cached history: the speed-up on long videos."),
                io.Boolean.Input("annca", default=d.annca,
                                 tooltip="Sparse cross-attention over the prompt. Off by default: over Wan's 512 "
                                         "prompt tokens dense cross-attention is already ~0.1 ms a call, less than "
                                         "selecting tokens costs."),
                io.Float.Input("keep_mass", default=d.keep_mass, min=0.0, max=1.0, step=0.01,
                               tooltip="Share of each query block's estimated attention the history blocks it "
                                       "reads must hold: higher is closer to dense and slower; 0 reads only "
                                       "keep_fraction of the blocks."),
                io.Float.Input("keep_fraction", default=d.keep_fraction, min=0.01, max=1.0, step=0.01,
                               tooltip="Share of the history blocks each query block reads at least: the floor "
                                       "under keep_mass (higher: closer to dense, slower)."),
                io.Float.Input("dense_steps_fraction", default=d.dense_steps_fraction, min=0.0, max=1.0, step=0.05,
                               tooltip="Denoising steps run dense first (the paper: the first ~30%): more keeps "
                                       "the layout of each chunk exact; 1.0 is dense throughout."),
            ],
            outputs=[AnnType.Output()],
        )

    @classmethod
    def execute(cls, annsa, annca, keep_mass, keep_fraction, dense_steps_fraction) -> io.NodeOutput:
        with _in_words("ANN Sparsity", "AnnConfig."):
            return io.NodeOutput(AnnConfig(annsa=bool(annsa), annca=bool(annca), keep_mass=float(keep_mass),
                                           keep_fraction=float(keep_fraction),
                                           dense_steps_fraction=float(dense_steps_fraction)))


FRAMES_PER_CHUNK = ("3", "1")
MAX_LENGTH = 100001


def _check_length(length: int) -> int:
    """Latent frames of a video ``length`` (1 + 4k frames), or one clear error."""
    if not 1 <= length <= MAX_LENGTH:
        raise FastARError(f"length {length} must lie in [1, {MAX_LENGTH}] video frames")
    if (length - 1) % 4:
        lo, hi = length - (length - 1) % 4, length - (length - 1) % 4 + 4
        raise FastARError(f"length {length} is not 1 + 4k video frames (what Wan's VAE decodes to); use {lo} or {hi}")
    return latent_frames(length)


def _check_widget(node, name: str, value) -> None:
    """ComfyUI's own min / max check of a number input, which it skips for the inputs a node's
    validate_inputs reads (the same bounds, from the node's schema)."""
    spec = next(i for i in node.define_schema().inputs if i.id == name)
    if spec.min is not None and value < spec.min:
        raise FastARError(f"{name} {value} is smaller than its minimum {spec.min}")
    if spec.max is not None and value > spec.max:
        raise FastARError(f"{name} {value} is bigger than its maximum {spec.max}")


def _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk, context_noise, cfg,
              cache) -> bridge.SampleSettings:
    """Validated rollout settings (raises FastARError with one clear line)."""
    if str(frames_per_chunk) not in FRAMES_PER_CHUNK:
        raise FastARError(f"frames_per_chunk {frames_per_chunk!r} is not one of {', '.join(FRAMES_PER_CHUNK)}")
    chunk = int(frames_per_chunk)
    frames = _check_length(int(length))
    FlowMatchSchedule.parse(timesteps, shift=float(shift))
    for name, value in (("width", width), ("height", height)):
        if value % 16:
            raise FastARError(f"{name} {value} is not a multiple of 16 pixels")
    return bridge.SampleSettings(width=int(width), height=int(height), frames=frames, batch_size=int(batch_size),
                                 seed=int(seed), timesteps=timesteps, shift=float(shift), chunk_frames=chunk,
                                 context_noise=float(context_noise), cache=cache, cfg=float(cfg))


class AutoregressiveLongSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(
            node_id="FastARAutoregressiveSampler",
            display_name="Autoregressive Long Sampler",
            description="Generates a video latent chunk by chunk with a causal Wan 2.1 model (Self-Forcing "
                        "sampler: a few flow-matching steps per chunk, then a clean pass that writes the chunk "
                        "into the KV cache). Decode the LATENT with the stock VAE Decode.",
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
                _prompts_input("positive"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, width, height, length, timesteps, frames_per_chunk):
        """What /prompt can refuse before anything runs, in the node's words. ComfyUI shows a message from
        here on each input this function reads and skips its own min / max (and combo options) for them, so
        those are checked here too (``_check_widget``); every other input keeps ComfyUI's checks."""
        try:
            if str(frames_per_chunk) not in FRAMES_PER_CHUNK:  # ComfyUI 0.3.64 checks no V3 combo's options
                raise FastARError(f"frames_per_chunk {frames_per_chunk!r} is not one of {', '.join(FRAMES_PER_CHUNK)}")
            for name, value in (("width", width), ("height", height)):
                _check_widget(cls, name, value)
                if int(value) % 16:
                    raise FastARError(f"{name} {value} is not a multiple of 16 pixels")
            _check_widget(cls, "length", length)
            _check_length(int(length))
            FlowMatchSchedule.parse(str(timesteps))
        except FastARError as exc:
            return f"Autoregressive Long Sampler: {exc}"
        return True

    @classmethod
    def execute(cls, model, positive, width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                context_noise, cfg, negative=None, prompts=None) -> io.NodeOutput:
        if not bridge.is_patched(model):
            model = PatchModel.execute(model).result[0]
        fastar = model.model_options.get(bridge.SETTINGS_KEY, {})
        with _in_words("Autoregressive Long Sampler"):
            settings = _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                                 context_noise, cfg, fastar.get("cache", TempCacheConfig()))
        settings.ann, settings.prompts = fastar.get("ann"), prompts
        events = CacheEvents(_node_id(cls))
        chunks = -(-settings.frames // settings.chunk_frames)
        events.start(chunks * settings.chunk_frames, chunks, len(prompts) if prompts else 1,  # a last chunk whole,
                     length=int(length))                                                   # cut to length
        try:
            latent = bridge.sample(model, positive, negative, settings, on_chunk=events, on_engine=events.engine)
        except BaseException:
            events.finish("stopped")
            raise
        events.finish("done")
        return io.NodeOutput(latent)


def _node_id(cls):
    return getattr(getattr(cls, "hidden", None), "unique_id", None)


class ARVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(
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
                _prompts_input("SamplerCustom's positive"),
            ],
            outputs=[io.Sampler.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, num_frame_per_block):
        """Block sizes the causal Wan 2.1 checkpoints are trained with, refused by /prompt otherwise
        (ComfyUI skips its own min / max for the input read here: checked here too). No checkpoint file
        records its block size (ComfyUI keeps no such metadata), so the known sizes are the check."""
        try:
            _check_widget(cls, "num_frame_per_block", num_frame_per_block)
            if str(num_frame_per_block) not in FRAMES_PER_CHUNK:
                raise FastARError(f"num_frame_per_block {num_frame_per_block} is not a block size a causal Wan 2.1 "
                                  f"checkpoint is trained with: 1 (framewise: Causal-Forcing framewise) or 3 "
                                  f"(chunkwise: Self-Forcing, CausVid, Causal-Forcing chunkwise); use the "
                                  f"checkpoint's own")
        except FastARError as exc:
            return f"FAST-AR AR Video: {exc}"
        return True

    @classmethod
    def execute(cls, num_frame_per_block, prompts=None) -> io.NodeOutput:
        return io.NodeOutput(bridge.ARVideoSampler(int(num_frame_per_block), events=CacheEvents(_node_id(cls)),
                                                   prompts=prompts))


class PromptSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        inputs = [io.Conditioning.Input("prompt_1", tooltip="The prompt from the first frame.")]
        for i in range(2, SCHEDULE_SLOTS + 1):
            inputs += [
                io.Conditioning.Input(f"prompt_{i}", optional=True,
                                      tooltip=f"The prompt from start_{i} on (leave unconnected for fewer prompts)."),
                io.Int.Input(f"start_{i}", default=80 * (i - 1), min=1, max=MAX_LENGTH,
                             tooltip=f"The video frame where prompt_{i} begins (16 frames = 1 s). The switch "
                                     f"happens with the first chunk that starts there or later."),
            ]
        return _schema(
            node_id="FastARPromptSchedule",
            display_name="FAST-AR Prompt Schedule",
            description="Prompts that change along the video, for the prompts input of Autoregressive Long Sampler "
                        "or FAST-AR AR Video: at each switch the new text conditions the chunks that follow and the "
                        "cached history is re-encoded with it (one clean pass per chunk so far), so the video "
                        "follows without a cut. Every frame before a switch is the earlier prompt's.",
            inputs=inputs,
            outputs=[PromptsType.Output()],
        )

    @classmethod
    def validate_inputs(cls, start_2, start_3, start_4, prompt_2=_UNCONNECTED, prompt_3=_UNCONNECTED,
                        prompt_4=_UNCONNECTED):
        """Starts out of order, refused by /prompt. While ComfyUI validates, a connected prompt arrives as
        None and an unconnected one not at all (the default here): only connected slots count. ComfyUI
        skips its own min / max for the starts read here, so they are checked here too."""
        slots = {2: (start_2, prompt_2), 3: (start_3, prompt_3), 4: (start_4, prompt_4)}
        try:
            for i, (start, _) in slots.items():
                _check_widget(cls, f"start_{i}", start)
            _ordered_starts({i: int(start) for i, (start, prompt) in slots.items() if prompt is not _UNCONNECTED})
        except FastARError as exc:
            return f"FAST-AR Prompt Schedule: {exc}"
        return True

    @classmethod
    def execute(cls, prompt_1, **slots) -> io.NodeOutput:
        used = {i: int(slots[f"start_{i}"]) for i in range(2, SCHEDULE_SLOTS + 1)
                if slots.get(f"prompt_{i}") is not None}
        with _in_words("FAST-AR Prompt Schedule"):
            _ordered_starts(used)
        return io.NodeOutput([(0, prompt_1)] + [(start, slots[f"prompt_{i}"]) for i, start in used.items()])


def _ordered_starts(starts: dict[int, int]) -> None:
    """The starts of the connected slots (slot number -> video frame), or one error naming the first
    start that does not come after the one before it."""
    last = ("the first frame", 0)
    for i, start in sorted(starts.items()):
        if start <= last[1]:
            raise FastARError(f"start_{i} ({start}) must come after {last[0]} ({last[1]}); the prompts start "
                              f"in order")
        last = (f"start_{i}", start)


class SaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(
            node_id="FastARSaveVideo",
            display_name="FAST-AR Save Video (streaming)",
            description="Decodes a video LATENT with the Wan 2.1 VAE and writes it to a video file frame by frame: "
                        "the memory stays that of a few frames however long the video (VAE Decode + Save Video "
                        "hold every frame at once). The frames are VAE Decode's. Cancel closes the file with the "
                        "frames written so far.",
            inputs=[
                io.Latent.Input("samples", tooltip="The video latent (Autoregressive Long Sampler, SamplerCustom)."),
                io.Vae.Input("vae", tooltip="The Wan 2.1 VAE (wan_2.1_vae.safetensors)."),
                io.Float.Input("fps", default=16.0, min=1.0, max=120.0, step=1.0,
                               tooltip="Frames per second (Wan 2.1 generates at 16)."),
                io.String.Input("filename_prefix", default="video/FastAR",
                                tooltip="As Save Video's: a path under ComfyUI's output folder."),
                io.Combo.Input("format", options=list(video.FORMATS), default="mp4",
                               tooltip="mp4 (H.264) or webm (VP9); both play in the browser."),
            ],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, samples, vae, fps, filename_prefix, format) -> io.NodeOutput:
        folder_paths = bridge.comfy_module("folder_paths")
        latent = samples["samples"]
        if latent.ndim != 5:
            raise FastARError(f"{video.NODE}: samples must be a video latent [B, C, T, h, w], got "
                              f"{list(latent.shape)}")
        width, height = latent.shape[-1] * 8, latent.shape[-2] * 8
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height)
        filename = f"{name}_{counter:05}_.{format}"
        progress = comfy.utils.ProgressBar(latent.shape[0] * latent.shape[2])

        def tick(done):
            progress.update_absolute(done)
            comfy.model_management.throw_exception_if_processing_interrupted()

        video.write_video(os.path.join(folder, filename), video.decoded_frames(vae, latent, tick), fps, format)
        return io.NodeOutput(ui=ui.PreviewVideo([ui.SavedResult(filename, subfolder, io.FolderType.output)]))


class CacheEvents:
    """``fastar.cache`` events for the cache widget: plain numbers only (the widget formats them)."""

    def __init__(self, node):
        self.node = None if node is None else str(node)
        self.total, self.chunks, self.video_total = 0, 0, 0
        self.t0 = time.perf_counter()
        self.last = None
        self.engine_name, self.engine_reason = None, None
        self.prompts = 1

    def _send(self, data: dict) -> None:
        bridge.send_event(CACHE_EVENT, {"node": self.node, "engine": self.engine_name,
                                        "engine_reason": self.engine_reason, **data})

    def start(self, total_frames: int, chunks: int, prompts: int = 1, length: int | None = None) -> None:
        """``total_frames`` latent frames in ``chunks`` chunks; ``length``: the video frames asked for,
        where whole chunks overshoot them and the latent is cut to them (default: all the chunks decode to)."""
        self.total, self.chunks, self.prompts, self.last = total_frames, chunks, prompts, None
        self.video_total = video_frames(total_frames) if length is None else min(length, video_frames(total_frames))
        self.t0 = time.perf_counter()
        self._send({"status": "running", **self._frames(0, self.total), "chunk": 0,
                    "chunks": self.chunks, "prompt": 1, "prompts": prompts})

    def _frames(self, done: int, total: int) -> dict:
        """Frames done / total in latent frames (what the rollout counts) and in video frames (what
        ``length`` counts: the widget shows these)."""
        video_total = self.video_total if total == self.total else video_frames(total)
        return {"frames_done": done, "total_frames": total,
                "video_frames_done": min(video_frames(done), video_total), "video_total_frames": video_total}

    def engine(self, engine) -> None:
        self.engine_name, self.engine_reason = engine.name, engine.reason

    def __call__(self, r) -> None:
        s = r.cache
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.last = {
            "status": "running", "chunk": r.chunk + 1, "chunks": r.num_chunks,
            **self._frames(r.frames_done, r.total_frames),
            "tokens": s.tokens_held, "dense_tokens": s.dense_tokens, "capacity_tokens": s.capacity_tokens,
            "gb": s.gb, "held_gb": s.held_gb, "dense_gb": s.dense_gb,
            "relative": (s.tokens_held / s.dense_tokens) if s.dense_tokens else 1.0,
            "latency_s": r.latency_s, "chunks_per_s": (r.chunk + 1) / elapsed,
            "annsa_density": r.annsa_density,  # None without AnnSA
            "annsa_sparse": r.annsa_sparse,    # share of AnnSA's layers that ran sparse; None without AnnSA
            "prompt": r.prompt + 1, "prompts": self.prompts,
        }
        self._send(self.last)

    def finish(self, status: str) -> None:
        self._send({**(self.last or self._frames(0, self.total)), "status": status})


NODES = [PatchModel, TempCacheSettings, WindowCache, AnnSparsity, AutoregressiveLongSampler, ARVideo,
         PromptSchedule, SaveVideo]
