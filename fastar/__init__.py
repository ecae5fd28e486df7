"""FAST-AR core: autoregressive video diffusion over a bounded, compressible KV cache.

Pure torch; imports no ComfyUI. The node pack (``nodes/``) and the CLI (``python -m
comfyui_fastar.fastar`` or ``fastar``) are thin layers over this package.
"""
from .annca import AnnCA
from .annsa import AnnSA
from .attention import FastARAttention
from .chunk_model import ChunkModel, ChunkReport
from .config import CACHE_MODES, AnnConfig, CacheConfig, ShortHistory, TempCacheConfig, UnsortableCache, check_settings
from .errors import FastARError
from .frames import latent_frames, video_frames
from .kvcache import CacheStats, FrameCache, KVCache, Layout
from .rollout import Rollout, pad_context, rollout
from .schedule import FlowMatchSchedule
from .backend import attend
from .tempcache import TempCache, make_cache

__all__ = [
    "AnnCA", "AnnConfig", "AnnSA", "CACHE_MODES", "CacheConfig", "CacheStats", "ChunkModel", "ChunkReport",
    "FastARAttention", "FastARError", "FlowMatchSchedule", "FrameCache", "KVCache", "Layout", "Rollout", "ShortHistory",
    "TempCache", "TempCacheConfig", "UnsortableCache", "attend", "check_settings", "latent_frames", "make_cache",
    "pad_context", "rollout", "video_frames",
]
