"""FAST-AR core: autoregressive video diffusion over a bounded, compressible KV cache.

Pure torch; imports no ComfyUI. The node pack (``nodes/``) and the CLI (``python -m
comfyui_fastar.fastar`` or ``fastar``) are thin layers over this package.
"""
from .ann import AnnCA, AnnConfig, AnnSA
from .attention import FastARAttention, attend, block_causal_mask, frame_visibility
from .errors import FastARError
from .kvcache import CACHE_MODES, CacheConfig, CacheStats, KVCache
from .rollout import ChunkModel, ChunkReport, Rollout, pad_context, rollout
from .schedule import FlowMatchSchedule
from .tempcache import TempCache, TempCacheConfig

__all__ = [
    "AnnCA", "AnnConfig", "AnnSA", "CACHE_MODES", "CacheConfig", "CacheStats", "ChunkModel", "ChunkReport", "FastARAttention", "FastARError",
    "FlowMatchSchedule", "KVCache", "Rollout", "TempCache", "TempCacheConfig", "attend", "block_causal_mask", "frame_visibility", "pad_context", "rollout",
]
