"""The nodes that set a graph's FAST-AR settings: FAST-AR Patch Model, which puts them on the model, and
the cache and sparsity settings it takes. The widgets' defaults are the library configs' own."""
from __future__ import annotations

from comfy_api.latest import io

from ..fastar import AnnConfig, CacheConfig, FastARError, TempCacheConfig, check_settings
from .patching import patch_model
from .schema import ADVANCED, AnnType, CacheType, check_widget, schema
from .words import in_words, node_message
from .settings import FastARSettings

CHUNK_FRAMES = 3  # the largest chunk the samplers take (latent frames): chunkwise checkpoints


class PatchModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = FastARSettings()
        return schema(
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
                io.Boolean.Input("fp8_linears", default=d.fp8_linears, optional=True,
                                 tooltip="The blocks' linear layers as fp8 matmuls (fp8_e4m3fn weights as they are, "
                                         "bf16 / fp16 ones through an fp8 copy of half their size). Faster on 14B "
                                         "models, slower on 1.3B ones, at a few % of each layer's output in error, "
                                         "which a long video adds up (dB below bf16: see the README); "
                                         "needs a GPU with fp8 tensor cores (RTX 40 / H100 on)."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, cache=None, ann=None, fp8_linears=False) -> io.NodeOutput:
        fields = {"ann": ann, "fp8_linears": bool(fp8_linears)}
        if cache is not None:  # else FastARSettings' default cache
            fields["cache"] = cache
        settings = FastARSettings(**fields)
        settings.check(1, "FAST-AR Patch Model")
        return io.NodeOutput(patch_model(model, settings, node="FAST-AR Patch Model"))


class TempCacheSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = TempCacheConfig()
        return schema(
            node_id="FastARTempCacheSettings",
            display_name="TempCache Settings",
            description="KV-cache compression by temporal correspondence (FAST-AR TempCache): each new key finds "
                        "its nearest cached key; close pairs merge into one key with a log-count bias, which is "
                        "exact for identical keys. The cache never exceeds max cache frames.",
            inputs=[
                io.Boolean.Input("enabled", default=d.enabled, **ADVANCED,
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
                io.Int.Input("recall_frames", default=d.recall_frames, min=0, max=64, step=1, optional=True,
                             tooltip="The memory tier: frames are also kept in host memory, and each chunk "
                                     "attends this many older frames beside the cache, those recent queries "
                                     "favour (a place seen long ago, recalled on return). 0: off. GPU memory "
                                     "stays flat; host memory grows with the video up to 16 GiB, then the oldest "
                                     "frames are thinned. Not with AnnSA."),
            ],
            outputs=[CacheType.Output()],
        )

    @classmethod
    def validate_inputs(cls, max_cache_frames, sink_frames, recall_frames=0):
        """A budget that leaves no room for a chunk beside the sink, refused at /prompt; each input read here
        checked against its widget's range. The sampler's chunk size is not known here: the largest (3 latent
        frames, the chunkwise checkpoints') is asked for, which a framewise rollout needs no less to keep any
        history."""
        try:
            check_widget(cls, "max_cache_frames", max_cache_frames)
            check_widget(cls, "sink_frames", sink_frames)
            check_widget(cls, "recall_frames", recall_frames)
            config = TempCacheConfig(max_cache_frames=int(max_cache_frames), sink_frames=int(sink_frames))
            check_settings(config, None, CHUNK_FRAMES)
        except FastARError as exc:
            return node_message("TempCache Settings", exc)
        return True

    @classmethod
    def execute(cls, enabled, merge_threshold, max_cache_frames, sink_frames, recall_frames=0) -> io.NodeOutput:
        with in_words("TempCache Settings"):
            return io.NodeOutput(TempCacheConfig(enabled=enabled, merge_threshold=float(merge_threshold),
                                                 max_cache_frames=int(max_cache_frames), sink_frames=int(sink_frames),
                                                 recall_frames=int(recall_frames)))


class WindowCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = CacheConfig()
        return schema(
            node_id="FastARWindowCache",
            display_name="Sink + Window Cache",
            description="A dense KV cache: the first sink frames and the most recent window frames (LongLive's "
                        "sink 3 + window 12; flat memory, no memory of the frames in between), or with unbounded "
                        "every frame (the dense baseline: memory and time grow with the video).",
            inputs=[
                io.Int.Input("sink_frames", default=d.sink_frames, min=0, max=64,
                             tooltip="First latent frames always kept (the attention sink)."),
                io.Int.Input("window_frames", default=d.window_frames, min=1, max=1024,
                             tooltip="Most recent latent frames kept before the chunk."),
                io.Boolean.Input("unbounded", default=False,
                                 tooltip="Keep every frame instead (the dense baseline FAST-AR is measured against)."),
            ],
            outputs=[CacheType.Output()],
        )

    @classmethod
    def execute(cls, sink_frames, window_frames, unbounded) -> io.NodeOutput:
        with in_words("Sink + Window Cache"):
            return io.NodeOutput(CacheConfig("unbounded" if unbounded else "window", int(sink_frames),
                                             int(window_frames)))


class AnnSparsity(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = AnnConfig()
        return schema(
            node_id="FastARAnnSparsity",
            display_name="ANN Sparsity",
            description="Approximate-nearest-neighbour sparse attention (FAST-AR AnnSA / AnnCA): a block of the "
                        "chunk's queries reads only the cached key blocks that score best against it (int8 "
                        "similarity to blocks of bucket-sorted keys), and, with AnnCA, each frame only the prompt "
                        "tokens that share a bucket with it. The current chunk and the sink stay dense. Needs "
                        "TempCache Settings or an unbounded cache on FAST-AR Patch Model. Off by default: it pays "
                        "only with long budgets (max cache frames 21 and more) on content whose attention spreads "
                        "over the history (then ~0.95x TempCache alone's time, at some fidelity). Where it cannot "
                        "pay it stands aside: below a history twice the sink and chunk it does nothing (the "
                        "default 12 frames), and a layer whose plans read most keys runs dense from then on.",
            inputs=[
                io.Boolean.Input("annsa", default=d.annsa,
                                 tooltip="Sparse self-attention over the cached history: the speed-up on long videos."),
                # stays though measured not to pay at Wan's shapes: saved workflows carry its widget value
                io.Boolean.Input("annca", default=d.annca, **ADVANCED,
                                 tooltip="Sparse cross-attention over the prompt. Off by default: over Wan's 512 "
                                         "prompt tokens dense cross-attention is already ~0.1 ms a call, less than "
                                         "selecting tokens costs."),
                io.Float.Input("keep_mass", default=d.keep_mass, min=0.5, max=1.0, step=0.01,
                               tooltip="Share of each query block's estimated attention the history blocks it "
                                       "reads must hold: higher is closer to dense and slower."),
                io.Float.Input("keep_fraction", default=d.keep_fraction, min=0.01, max=1.0, step=0.01, **ADVANCED,
                               tooltip="Share of the history blocks each query block reads at least: the floor "
                                       "under keep_mass (higher: closer to dense, slower)."),
                io.Float.Input("dense_steps_fraction", default=d.dense_steps_fraction, min=0.0, max=1.0, step=0.05,
                               **ADVANCED,
                               tooltip="Denoising steps run dense first (the paper: the first ~30%): more keeps "
                                       "the layout of each chunk exact; 1.0 is dense throughout."),
            ],
            outputs=[AnnType.Output()],
        )

    @classmethod
    def execute(cls, annsa, annca, keep_mass, keep_fraction, dense_steps_fraction) -> io.NodeOutput:
        with in_words("ANN Sparsity"):
            return io.NodeOutput(AnnConfig(annsa=bool(annsa), annca=bool(annca), keep_mass=float(keep_mass),
                                           keep_fraction=float(keep_fraction),
                                           dense_steps_fraction=float(dense_steps_fraction)))

