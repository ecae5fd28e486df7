"""The FAST-AR nodes (ComfyUI V3 schema). Glue only: inputs become ``fastar`` settings, the
bridge runs them, results go back to ComfyUI."""
from __future__ import annotations

import contextlib
import time

from comfy_api.latest import io

from ..fastar import CACHE_MODES, CacheConfig, FastARError, FlowMatchSchedule, TempCacheConfig
from ..fastar.ann import ANN_METHODS, MAX_BITS, AnnConfig
from ..fastar.tempcache import GROUPING_MODES, MATCHING_MODES
from . import bridge

CATEGORY = "FAST-AR"
TempCacheType = io.Custom("FASTAR_TEMPCACHE")
AnnType = io.Custom("FASTAR_ANN")
CACHE_EVENT = "fastar.cache"


@contextlib.contextmanager
def _in_words(library: str, node: str):
    """A settings error in the node's words: the library's ``TempCacheConfig.x`` is the node's input x."""
    try:
        yield
    except FastARError as exc:
        raise FastARError(str(exc).replace(library, node, 1)) from None


class PatchModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARPatchModel",
            display_name="FAST-AR Patch Model",
            category=CATEGORY,
            description="Routes a Wan 2.1 text-to-video model's attention through FAST-AR during autoregressive "
                        "rollouts. Returns a copy: the input model is untouched, and outside an Autoregressive "
                        "Long Sampler the copy samples exactly like the stock model.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1 T2V / causal (Self-Forcing, CausVid, LongLive) model."),
                TempCacheType.Input("tempcache", optional=True,
                                    tooltip="TempCache settings: compress the KV cache by merging temporally "
                                            "corresponding keys. Leave empty for the cache mode of the sampler."),
                AnnType.Input("ann", optional=True,
                              tooltip="ANN sparsity settings (AnnSA / AnnCA). Leave empty for dense attention."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, tempcache=None, ann=None) -> io.NodeOutput:
        settings = {}
        if tempcache is not None:
            settings["tempcache"] = tempcache
        if ann is not None:
            settings["ann"] = ann
        return io.NodeOutput(bridge.patch_model(model, settings))


class TempCacheSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = TempCacheConfig()
        return io.Schema(
            node_id="FastARTempCacheSettings",
            display_name="TempCache Settings",
            category=CATEGORY,
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
                io.Combo.Input("matching", options=list(MATCHING_MODES), default=d.matching,
                               tooltip="Find each new token's counterpart by its key (cosine) or by its query "
                                       "(attention argmax)."),
                io.Combo.Input("grouping", options=list(GROUPING_MODES), default=d.grouping,
                               tooltip="Correspondence per attention head, or one shared by all heads."),
            ],
            outputs=[TempCacheType.Output()],
        )

    @classmethod
    def execute(cls, enabled, merge_threshold, max_cache_frames, sink_frames, matching, grouping) -> io.NodeOutput:
        with _in_words("TempCacheConfig.", "TempCache Settings: "):
            return io.NodeOutput(TempCacheConfig(enabled=enabled, merge_threshold=float(merge_threshold),
                                                 max_cache_frames=int(max_cache_frames), sink_frames=int(sink_frames),
                                                 matching=matching, grouping=grouping))


class AnnSparsity(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = AnnConfig()
        return io.Schema(
            node_id="FastARAnnSparsity",
            display_name="ANN Sparsity",
            category=CATEGORY,
            description="Approximate-nearest-neighbour sparse attention (FAST-AR AnnSA / AnnCA): a query block "
                        "attends only to the cached keys that score best against it (quant: int8 similarity to "
                        "blocks of bucket-sorted keys, the default) or that share its LSH buckets (lsh), and, with "
                        "AnnCA, to the prompt tokens that share a bucket with its frame. The current chunk and the "
                        "sink stay dense.",
            inputs=[
                io.Combo.Input("method", options=list(ANN_METHODS), default=d.method,
                               tooltip="lsh: sign-of-random-projection buckets; quant: int8 similarity of query "
                                       "blocks to blocks of bucket-sorted keys (keep_fraction / keep_mass)."),
                io.Int.Input("bits", default=d.bits, min=1, max=MAX_BITS, step=1,
                             tooltip="LSH hyperplanes per layer and head (2^bits buckets). More bits: sparser, "
                                     "faster, less exact. bits 1 with probes 1 is exactly dense."),
                io.Int.Input("probes", default=d.probes, min=0, max=MAX_BITS, step=1,
                             tooltip="A query's least certain bits also flipped (radius-1 probes, at most bits): "
                                     "more probes keep more keys."),
                io.Combo.Input("block_q", options=["64", "128"], default=str(d.block_q),
                               tooltip="Queries per block of the block-sparse kernel."),
                io.Float.Input("dense_steps_fraction", default=d.dense_steps_fraction, min=0.0, max=1.0, step=0.05,
                               tooltip="Denoising steps run dense first (the paper: the first ~30%); 1.0 is "
                                       "dense throughout."),
                io.String.Input("dense_layers", default=",".join(str(i) for i in d.dense_layers),
                                tooltip="Comma-separated layer indices that always run dense (layers that are not "
                                        "measurably sparse)."),
                io.Boolean.Input("annsa", default=d.annsa, tooltip="Sparse self-attention over the KV cache."),
                io.Boolean.Input("annca", default=d.annca,
                                 tooltip="Sparse cross-attention over the prompt. Off by default: over Wan's 512 "
                                         "prompt tokens dense cross-attention is already ~0.1 ms a call, less than "
                                         "selecting tokens costs."),
                io.Float.Input("keep_fraction", default=d.keep_fraction, min=0.01, max=1.0, step=0.01,
                               tooltip="quant: share of history key blocks each query block reads (with keep_mass: "
                                       "at least)."),
                io.Float.Input("keep_mass", default=d.keep_mass, min=0.0, max=1.0, step=0.01,
                               tooltip="quant: a query block also reads more history blocks until, with the sink "
                                       "and its own chunk, they hold this share of its estimated attention mass "
                                       "(top-p): diffuse attention reads more, local attention less. 0: only "
                                       "keep_fraction of the blocks (faster where attention is diffuse, lower "
                                       "recall there)."),
                io.Int.Input("min_tokens", default=d.min_tokens, min=0, max=4096, step=1,
                             tooltip="AnnCA keeps at least this many prompt tokens per frame."),
            ],
            outputs=[AnnType.Output()],
        )

    @classmethod
    def execute(cls, method, bits, probes, block_q, dense_steps_fraction, dense_layers, annsa, annca, keep_fraction,
                keep_mass, min_tokens) -> io.NodeOutput:
        try:
            layers = tuple(int(t) for t in str(dense_layers).replace(" ", "").split(",") if t)
        except ValueError:
            raise FastARError(f"dense_layers must be comma-separated layer indices, got {dense_layers!r}") from None
        with _in_words("AnnConfig.", "ANN Sparsity: "):
            return io.NodeOutput(AnnConfig(method=method, bits=int(bits), probes=int(probes), block_q=int(block_q),
                                           dense_steps_fraction=float(dense_steps_fraction), dense_layers=layers,
                                           annsa=bool(annsa), annca=bool(annca), keep_fraction=float(keep_fraction),
                                           keep_mass=float(keep_mass), min_tokens=int(min_tokens)))


FRAMES_PER_CHUNK = ("3", "1")
MAX_LENGTH = 100001


def _check_length(length: int, chunk: int) -> int:
    """Latent frames of a video ``length`` (1 + 4k frames, whole chunks), or one clear error."""
    if not 1 <= length <= MAX_LENGTH:
        raise FastARError(f"length {length} must lie in [1, {MAX_LENGTH}] video frames")
    if (length - 1) % 4:
        lo, hi = length - (length - 1) % 4, length - (length - 1) % 4 + 4
        raise FastARError(f"length {length} is not 1 + 4k video frames (what Wan's VAE decodes to); use {lo} or {hi}")
    frames = bridge.latent_frames(length)
    if frames % chunk:
        lo = ((frames // chunk) * chunk - 1) * 4 + 1
        hi = ((frames // chunk + 1) * chunk - 1) * 4 + 1
        hint = f"use {lo} or {hi}" if lo >= 1 else f"use {hi}"
        raise FastARError(f"length {length} gives {frames} latent frames, not a multiple of {chunk} frames per "
                          f"chunk; {hint}")
    return frames


def _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk, context_noise,
              cache_mode, sink_frames, window_frames, cfg, tempcache=None) -> bridge.SampleSettings:
    """Validated rollout settings (raises FastARError with one clear line)."""
    chunk = int(frames_per_chunk)
    frames = _check_length(int(length), chunk)
    FlowMatchSchedule.parse(timesteps, shift=float(shift))
    cache = tempcache if tempcache is not None else CacheConfig(cache_mode, int(sink_frames), int(window_frames))
    for name, value in (("width", width), ("height", height)):
        if value % 16:
            raise FastARError(f"{name}={value} must be a multiple of 16 pixels")
    return bridge.SampleSettings(width=int(width), height=int(height), frames=frames, batch_size=int(batch_size),
                                 seed=int(seed), timesteps=timesteps, shift=float(shift), chunk_frames=chunk,
                                 context_noise=float(context_noise), cache=cache, cfg=float(cfg))


class AutoregressiveLongSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARAutoregressiveSampler",
            display_name="Autoregressive Long Sampler",
            category=CATEGORY,
            description="Generates a video latent chunk by chunk with a causal Wan 2.1 model (Self-Forcing "
                        "sampler: a few flow-matching steps per chunk, then a clean pass that writes the chunk "
                        "into the KV cache). Decode the LATENT with the stock VAE Decode.",
            inputs=[
                io.Model.Input("model", tooltip="A causal Wan 2.1 T2V model (patched with FAST-AR Patch Model, "
                                                "or patched here with the defaults)."),
                io.Conditioning.Input("positive", tooltip="The prompt (one text conditioning)."),
                io.Int.Input("width", default=832, min=16, max=4096, step=16, tooltip="Pixels; a multiple of 16."),
                io.Int.Input("height", default=480, min=16, max=4096, step=16, tooltip="Pixels; a multiple of 16."),
                io.Int.Input("length", default=81, min=1, max=MAX_LENGTH, step=4,
                             tooltip="Video frames (1 + 4k: 81 frames = 21 latent frames). The latent frame count "
                                     "must be a multiple of the frames per chunk."),
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
                io.Combo.Input("cache_mode", options=list(CACHE_MODES), default="window",
                               tooltip="unbounded keeps every frame (memory grows with the video); window keeps "
                                       "the sink frames and the most recent window frames (flat memory). A "
                                       "TempCache setting on the model overrides this."),
                io.Int.Input("sink_frames", default=3, min=0, max=64,
                             tooltip="window mode: first latent frames always kept (LongLive uses 3)."),
                io.Int.Input("window_frames", default=12, min=1, max=1024,
                             tooltip="window mode: most recent latent frames kept before the chunk (LongLive "
                                     "uses 12)."),
                io.Float.Input("cfg", default=1.0, min=1.0, max=30.0, step=0.1,
                               tooltip="Classifier-free guidance. The distilled causal models use none (1.0); "
                                       "above 1 a negative prompt is needed and each forward runs twice the batch."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Negative prompt, used only when cfg > 1."),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, length=None, frames_per_chunk=None, cache_mode=None, timesteps=None):
        """The checks ComfyUI cannot make (ComfyUI 0.3.64 checks no V3 combo's options). Only the inputs
        named here skip ComfyUI's own type / min / max checks (and each message is shown on each of them),
        so they are the few that need ours."""
        try:
            for name, value, options in (("frames_per_chunk", frames_per_chunk, FRAMES_PER_CHUNK),
                                         ("cache_mode", cache_mode, CACHE_MODES)):
                if value is not None and str(value) not in options:
                    raise FastARError(f"{name} {value!r} is not one of {', '.join(options)}")
            if length is not None:
                _check_length(int(length), int(frames_per_chunk) if frames_per_chunk is not None else 1)
            if timesteps is not None:
                FlowMatchSchedule.parse(timesteps)
        except FastARError as exc:
            return f"Autoregressive Long Sampler: {exc}"
        return True

    @classmethod
    def execute(cls, model, positive, width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                context_noise, cache_mode, sink_frames, window_frames, cfg, negative=None) -> io.NodeOutput:
        if not bridge.is_patched(model):
            model = bridge.patch_model(model)
        fastar = model.model_options.get(bridge.SETTINGS_KEY, {})
        settings = _settings(width, height, length, batch_size, seed, timesteps, shift, frames_per_chunk,
                             context_noise, cache_mode, sink_frames, window_frames, cfg, fastar.get("tempcache"))
        settings.ann = fastar.get("ann")
        events = CacheEvents(_node_id(cls))
        events.start(settings.frames, settings.frames // settings.chunk_frames)
        try:
            latent = bridge.sample(model, positive, negative, settings, on_chunk=events, on_engine=events.engine)
        except BaseException:
            events.finish("stopped")
            raise
        events.finish("done")
        return io.NodeOutput(latent)


def _node_id(cls):
    return getattr(cls.hidden, "unique_id", None) if getattr(cls, "hidden", None) is not None else None


class ARVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARARVideo",
            display_name="FAST-AR AR Video",
            category=CATEGORY,
            description="FAST-AR's autoregressive sampler as a SAMPLER for SamplerCustom / SamplerCustomAdvanced: "
                        "put it where Sampler AR Video sits in ComfyUI's autoregressive video graph (Empty AR "
                        "Video Latent, the graph's sigmas and seed). The KV cache stays bounded (sink + window, or "
                        "TempCache and ANN Sparsity from FAST-AR Patch Model) instead of growing with the video.",
            inputs=[
                io.Int.Input("num_frame_per_block", default=1, min=1, max=64,
                             tooltip="Latent frames per autoregressive block (chunk). 1 = framewise, 3 = chunkwise; "
                                     "must match the checkpoint."),
                io.Combo.Input("cache_mode", options=list(CACHE_MODES), default="window",
                               tooltip="unbounded keeps every frame (memory grows with the video); window keeps "
                                       "the sink frames and the most recent window frames (flat memory). A "
                                       "TempCache setting on the model overrides this."),
                io.Int.Input("sink_frames", default=3, min=0, max=64,
                             tooltip="window mode: first latent frames always kept (LongLive uses 3)."),
                io.Int.Input("window_frames", default=12, min=1, max=1024,
                             tooltip="window mode: most recent latent frames kept before the block."),
            ],
            outputs=[io.Sampler.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, num_frame_per_block, cache_mode, sink_frames, window_frames) -> io.NodeOutput:
        cache = CacheConfig(cache_mode, int(sink_frames), int(window_frames))
        return io.NodeOutput(bridge.ARVideoSampler(int(num_frame_per_block), cache, events=CacheEvents(_node_id(cls))))


class CacheEvents:
    """``fastar.cache`` events for the cache widget: plain numbers only (the widget formats them)."""

    def __init__(self, node):
        self.node = None if node is None else str(node)
        self.total, self.chunks = 0, 0
        self.t0 = time.perf_counter()
        self.last = None
        self.engine_name, self.engine_reason = None, None

    def _send(self, data: dict) -> None:
        bridge.send_event(CACHE_EVENT, {"node": self.node, "engine": self.engine_name,
                                        "engine_reason": self.engine_reason, **data})

    def start(self, total_frames: int, chunks: int) -> None:
        self.total, self.chunks, self.last = total_frames, chunks, None
        self.t0 = time.perf_counter()
        self._send({"status": "running", "frames_done": 0, "total_frames": self.total, "chunk": 0,
                    "chunks": self.chunks})

    def engine(self, engine) -> None:
        self.engine_name, self.engine_reason = engine.name, engine.reason

    def __call__(self, r) -> None:
        s = r.cache
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.last = {
            "status": "running", "chunk": r.chunk + 1, "chunks": r.num_chunks,
            "frames_done": r.frames_done, "total_frames": r.total_frames,
            "tokens": s.tokens_held, "dense_tokens": s.dense_tokens, "capacity_tokens": s.capacity_tokens,
            "gb": s.gb, "held_gb": s.held_gb, "dense_gb": s.dense_gb,
            "relative": (s.tokens_held / s.dense_tokens) if s.dense_tokens else 1.0,
            "latency_s": r.latency_s, "chunks_per_s": (r.chunk + 1) / elapsed,
            "annsa_density": r.annsa_density,  # None without AnnSA
        }
        self._send(self.last)

    def finish(self, status: str) -> None:
        self._send({**(self.last or {"frames_done": 0, "total_frames": self.total}), "status": status})


NODES = [PatchModel, TempCacheSettings, AnnSparsity, AutoregressiveLongSampler, ARVideo]
