"""The FAST-AR settings a graph sets once, on FAST-AR Patch Model, and both samplers read from the
model: one frozen object in the patched model's ``model_options``."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..fastar import AnnConfig, CacheConfig, TempCacheConfig, check_settings
from .words import in_words

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
        """``fastar.check_settings`` for chunks of ``chunk_frames`` latent frames, in ``node``'s words."""
        with in_words(node):
            check_settings(self.cache, self.ann, chunk_frames)


def settings_of(model) -> FastARSettings:
    """The settings FAST-AR Patch Model put on a ModelPatcher; the defaults where it put none."""
    settings = model.model_options.get(SETTINGS_KEY)
    return FastARSettings() if settings is None else settings
