"""The settings of a rollout's KV cache and sparse attention: plain frozen dataclasses, checked on
construction, and ``check_settings`` for the ones that cannot run together; importable by the nodes
and the CLI without the hot path (no kernels, no torch)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import SettingError, ShortHistory, UnsortableCache
from .frames import frames_text

CACHE_MODES = ("unbounded", "window")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_fraction(x, lo_open: bool) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return (0.0 < x if lo_open else 0.0 <= x) and x <= 1.0


@dataclass(frozen=True)
class CacheConfig:
    """``unbounded`` keeps every frame; ``window`` keeps the first ``sink_frames`` frames and
    the last ``window_frames`` frames before the current chunk (LongLive: sink 3, window 12)."""
    mode: str = "unbounded"
    sink_frames: int = 3
    window_frames: int = 12

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise SettingError(f"{{CacheConfig.mode}} {self.mode!r} is unknown; expected one of {', '.join(CACHE_MODES)}")
        if not _is_int(self.sink_frames) or self.sink_frames < 0:
            raise SettingError(f"{{CacheConfig.sink_frames}} must be an integer >= 0, got {self.sink_frames!r}")
        if not _is_int(self.window_frames) or self.window_frames < 1:
            raise SettingError(f"{{CacheConfig.window_frames}} must be an integer >= 1, got {self.window_frames!r}")

    @property
    def bounded(self) -> bool:
        return self.mode == "window"

    @property
    def sortable(self) -> bool:
        """Whether AnnSA may bucket-sort the history: not a window's ring of frame slots."""
        return not self.bounded

    @property
    def history_frames(self) -> int | None:
        """The most recent frames past the sink this cache holds (None: every frame)."""
        return self.window_frames if self.bounded else None


@dataclass(frozen=True)
class TempCacheConfig:
    """TempCache: ``sink_frames`` kept whole, then a history of ``max_cache_frames - sink_frames``
    frames of token slots where a new token whose key's cosine with its best match among the
    whole tokens (all heads concatenated) clears ``merge_threshold`` merges into that group.
    ``enabled=False`` keeps the same budget with eviction only (no merging): the baseline
    TempCache is measured against, which is why it stays (``bench/tempcache_bench.py``'s evict-only).

    Why 12 frames: within the time of LongLive's sink 3 + window 12 cache (which holds 15), it keeps
    more of the past; a longer budget keeps more at more time per chunk. Why 0.8: on a trained model's
    keys (the pack's world model, whose places come back), a stricter threshold merges so few tokens
    that TempCache holds no more than a window of its budget, while 0.8 keeps what the window forgets.
    """
    enabled: bool = True
    merge_threshold: float = 0.8
    max_cache_frames: int = 12
    sink_frames: int = 3
    recall_frames: int = 0  # the memory tier (``fastar.recall``): frames read back from host memory; 0: none

    def __post_init__(self):
        if not _is_int(self.recall_frames) or self.recall_frames < 0:
            raise SettingError(f"{{TempCacheConfig.recall_frames}} must be an integer >= 0, got {self.recall_frames!r}")
        if not _is_fraction(self.merge_threshold, lo_open=True):
            raise SettingError(f"{{TempCacheConfig.merge_threshold}} must lie in (0, 1] (a cosine similarity), "
                              f"got {self.merge_threshold!r}")
        if not _is_int(self.sink_frames) or self.sink_frames < 0:
            raise SettingError(f"{{TempCacheConfig.sink_frames}} must be an integer >= 0, got {self.sink_frames!r}")
        if not _is_int(self.max_cache_frames) or self.max_cache_frames <= self.sink_frames:
            raise SettingError(f"{{TempCacheConfig.max_cache_frames}} must be an integer > {{TempCacheConfig.sink_frames}} "
                              f"({self.sink_frames}), got {self.max_cache_frames!r}")

    @property
    def history_frames(self) -> int:
        """The budget past the sink: the most recent frames' worth of tokens this cache holds."""
        return self.max_cache_frames - self.sink_frames

    @property
    def sortable(self) -> bool:
        """Whether AnnSA may bucket-sort the history: TempCache's token slots it may."""
        return True


MAX_BITS = 12


@dataclass(frozen=True)
class AnnConfig:
    """AnnSA / AnnCA settings.

    AnnSA: each block of ``block_q`` consecutive queries reads the sink, its own chunk and its
    best ``keep_fraction`` of the bucket-sorted history's key blocks, and more while they hold
    less than ``keep_mass`` of its estimated attention mass (``keep_mass=0``: the fixed share
    alone, which top-p replaced; it stays as what ``bench/ann_bench.py`` and ``ann_bound.py`` sweep).
    ``bits``: LSH hyperplanes the history is sorted by (2**bits buckets).
    AnnCA (off by default: over Wan's 512 prompt tokens dense cross-attention costs less than
    selecting tokens does; it stays as FAST-AR's third part, measured in docs/results.md) keeps per
    frame the prompt tokens that share an LSH bucket with one of its queries, ``probes`` of a query's least certain bits
    flipped, at least ``min_tokens``. Both run dense for the first ``dense_steps_fraction`` of
    the denoising steps (the clean pass counts as the step after the last) and in ``dense_layers``.
    """
    bits: int = 8
    probes: int = 2
    block_q: int = 64
    dense_steps_fraction: float = 0.3
    dense_layers: tuple[int, ...] = ()
    annsa: bool = True
    annca: bool = False
    min_tokens: int = 64
    seed: int = 0
    keep_fraction: float = 0.2
    keep_mass: float = 0.95

    def __post_init__(self):
        if not _is_int(self.bits) or not 1 <= self.bits <= MAX_BITS:
            raise SettingError(f"{{AnnConfig.bits}} must be an integer in [1, {MAX_BITS}], got {self.bits!r}")
        if not _is_int(self.probes) or not 0 <= self.probes <= self.bits:
            raise SettingError(f"{{AnnConfig.probes}} must be an integer in [0, {{AnnConfig.bits}}={self.bits}], got {self.probes!r}")
        if self.block_q not in (64, 128) or isinstance(self.block_q, bool):
            raise SettingError(f"{{AnnConfig.block_q}} must be 64 or 128, got {self.block_q!r}")
        if not _is_fraction(self.dense_steps_fraction, lo_open=False):
            raise SettingError(f"{{AnnConfig.dense_steps_fraction}} must lie in [0, 1], got {self.dense_steps_fraction!r}")
        try:
            layers = tuple(self.dense_layers)
        except TypeError:
            raise SettingError(f"{{AnnConfig.dense_layers}} must be a sequence of layer indices, "
                              f"got {self.dense_layers!r}") from None
        if not all(_is_int(i) and i >= 0 for i in layers):
            raise SettingError(f"{{AnnConfig.dense_layers}} must hold integers >= 0, got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", layers)
        for name in ("annsa", "annca"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(f"{{AnnConfig.{name}}} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SettingError(f"{{AnnConfig.min_tokens}} must be an integer >= 0, got {self.min_tokens!r}")
        if not _is_int(self.seed):
            raise SettingError(f"{{AnnConfig.seed}} must be an integer, got {self.seed!r}")
        if not _is_fraction(self.keep_fraction, lo_open=True):
            raise SettingError(f"{{AnnConfig.keep_fraction}} must lie in (0, 1], got {self.keep_fraction!r}")
        if not _is_fraction(self.keep_mass, lo_open=False):
            raise SettingError(f"{{AnnConfig.keep_mass}} must lie in [0, 1] (0: keep_fraction of the blocks only), "
                              f"got {self.keep_mass!r}")

    @property
    def buckets(self) -> int:
        return 1 << self.bits

    def sparse_at(self, layer: int, step: int | None, num_steps: int | None) -> bool:
        """Whether a forward at denoising ``step`` of ``num_steps`` runs sparse in ``layer``
        (unknown step: sparse). The clean pass is step ``num_steps``: sparse unless the fraction is 1."""
        if layer in self.dense_layers:
            return False
        if step is None or num_steps is None:
            return True
        return self.dense_steps_fraction < 1 and step >= round(self.dense_steps_fraction * num_steps)


def check_settings(cache: CacheConfig | TempCacheConfig, ann: AnnConfig | None, chunk_frames: int) -> None:
    """The settings that are valid alone (each config checks itself) but cannot run together in chunks
    of ``chunk_frames`` latent frames; each conflict raises its own ``SettingError`` type."""
    if ann is not None and ann.annsa and not cache.sortable:
        raise UnsortableCache("{AnnConfig.annsa} reads a bucket-sorted history, which a window cache does not keep "
                              "(its frames are a ring of slots); use TempCache or the unbounded cache, or turn "
                              "{AnnConfig.annsa} off")
    if ann is not None and ann.annsa and getattr(cache, "recall_frames", 0):
        raise SettingError("{TempCacheConfig.recall_frames} adds recalled frames that AnnSA's plans do not read; "
                           "turn {AnnConfig.annsa} off or set {TempCacheConfig.recall_frames} to 0")
    if isinstance(cache, TempCacheConfig) and cache.history_frames < chunk_frames:
        lower = (f" or {{TempCacheConfig.sink_frames}} to at most {cache.max_cache_frames - chunk_frames}"
                 if cache.max_cache_frames >= chunk_frames else "")
        raise ShortHistory(f"{{TempCacheConfig.max_cache_frames}} {cache.max_cache_frames} leaves "
                           f"{frames_text(cache.history_frames)} of history beside {frames_text(cache.sink_frames)} "
                           f"of sink, less than one chunk of {frames_text(chunk_frames)}; set "
                           f"{{TempCacheConfig.max_cache_frames}} to at least {cache.sink_frames + chunk_frames}"
                           + lower)
