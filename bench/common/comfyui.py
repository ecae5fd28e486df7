"""The ComfyUI benchmarks' shared parts (bench/comfy_bench.py, bench/prompt_switch.py, bench/stream_memory.py).

This checkout's pack is imported first (``common.fastar``); ComfyUI is then imported through the pack's own
harness (``harness``: ``comfyui_fastar.testing.comfy_harness``, which the ComfyUI tests run on too), which also
writes the model files ComfyUI loads. Here: the two settings the ComfyUI benchmarks run, their cache and
sparsity nodes at the nodes' defaults, and ComfyUI's diffusion-model loader as a graph calls it.
"""
from __future__ import annotations

from . import fastar  # noqa: F401  (this checkout as comfyui_fastar: the harness below is its own)

from comfyui_fastar.testing import comfy_harness as harness  # noqa: F401

SETTINGS = ("fastar", "window")  # FAST-AR's defaults (TempCache alone); dense sink 3 + window 12


def fastar_nodes(setting: str):
    """The cache and sparsity nodes' outputs of a setting, at the pack's defaults: TempCache Settings as it
    comes, no ANN Sparsity (off by default); the window: sink 3 + window 12."""
    from comfyui_fastar.fastar import TempCacheConfig
    from comfyui_fastar.nodes.settings_nodes import TempCacheSettings, WindowCache

    if setting != "fastar":
        return WindowCache.execute(3, 12, False).result[0], None
    t = TempCacheConfig()
    return TempCacheSettings.execute(t.enabled, t.merge_threshold, t.max_cache_frames, t.sink_frames).result[0], None


def load_unet(comfy, name: str, dtype_flag: str | None):
    """UNETLoader on the diffusion model ``name`` (a file in a folder registered for "diffusion_models"):
    ``dtype_flag`` "fp8" loads it with weight dtype fp8_e4m3fn, "bf16" under ComfyUI's ``--bf16-unet``, None
    at the defaults."""
    import comfy.cli_args
    from comfy.nodes.base_nodes import UNETLoader

    comfy.cli_args.args.bf16_unet = dtype_flag == "bf16"
    try:
        return UNETLoader().load_unet(name, "fp8_e4m3fn" if dtype_flag == "fp8" else "default")[0]
    finally:
        comfy.cli_args.args.bf16_unet = False
