"""The FAST-AR settings a graph sets once, on FAST-AR Patch Model, and both samplers read from the
model: one frozen object in the patched model's ``model_options``."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..fastar import AnnConfig, CacheConfig, FastARError, ShortHistory, TempCacheConfig, UnsortableCache, check_settings
from ..fastar.frames import frames_text

SETTINGS_KEY = "fastar"  # model_options key holding FAST-AR Patch Model's settings


@dataclass(frozen=True)
class FastARSettings:
    """A rollout's KV cache, its sparse attention (None: dense) and whether the fused engine runs the
    blocks' linear layers as fp8 matmuls. The defaults are a graph's without FAST-AR Patch Model:
    TempCache at the library's defaults, dense attention."""
    cache: CacheConfig | TempCacheConfig = field(default_factory=TempCacheConfig)
    ann: AnnConfig | None = None
    fp8_linears: bool = False

    def check(self, chunk_frames: int, node: str) -> None:
        """``fastar.check_settings`` for chunks of ``chunk_frames`` latent frames, named as the graph shows
        the settings."""
        try:
            check_settings(self.cache, self.ann, chunk_frames)
        except UnsortableCache:
            raise FastARError(f"{node}: ANN Sparsity's annsa reads a bucket-sorted cache, which a Sink + Window "
                              f"Cache does not keep (its frames are a ring); connect TempCache Settings to FAST-AR "
                              f"Patch Model's cache, turn the window cache's unbounded on, or set ANN Sparsity's "
                              f"annsa to false") from None
        except ShortHistory:
            cache = self.cache
            raise FastARError(f"{node}: TempCache Settings' max_cache_frames {cache.max_cache_frames} leaves "
                              f"{frames_text(cache.history_frames)} beside its {frames_text(cache.sink_frames)} of "
                              f"sink, less than one chunk of {chunk_frames}; set max_cache_frames to at least "
                              f"{cache.sink_frames + chunk_frames}") from None


def settings_of(model) -> FastARSettings:
    """The settings FAST-AR Patch Model put on a ModelPatcher; the defaults where it put none."""
    settings = model.model_options.get(SETTINGS_KEY)
    return FastARSettings() if settings is None else settings
