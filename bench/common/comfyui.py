"""The ComfyUI benchmarks' shared parts (bench/comfy_bench.py, bench/play_bench.py, bench/prompt_switch.py,
bench/stream_bench.py, bench/stream_memory.py).

This checkout's pack is imported first (``common.fastar``); ComfyUI is then imported through the pack's own
harness (``harness``: ``comfyui_fastar.testing.comfy_harness``, which the ComfyUI tests run on too), which also
writes the model files ComfyUI loads. Here: the two settings the ComfyUI benchmarks run, their cache and
sparsity nodes at the nodes' defaults, and ComfyUI's diffusion-model loader as a graph calls it.
"""
from __future__ import annotations

import time

from . import fastar  # noqa: F401  (this checkout as comfyui_fastar: the harness below is its own)

from comfyui_fastar.testing import comfy_harness as harness  # noqa: F401

SETTINGS = ("fastar", "window")  # FAST-AR's defaults (TempCache alone); dense sink 3 + window 12


class ChunkEvents:
    """The nodes' ``fastar.cache`` event of each finished chunk, caught where the pack sends it (no server
    here), while the ``with`` block runs: ``chunks`` holds (chunk, the rollout's seconds for it, when the event
    came by ``time.perf_counter``); ``engine`` the engine that ran; ``on_chunk(chunk, seconds)``, where given,
    is called as each comes."""

    def __init__(self, on_chunk=None):
        self.on_chunk, self.chunks, self.engine = on_chunk, [], None

    def __call__(self, event: str, data: dict) -> None:
        if event == "fastar.cache" and data.get("status") == "running" and data.get("chunk"):
            self.engine = data.get("engine")
            self.chunks.append((data["chunk"] - 1, data["latency_s"], time.perf_counter()))
            if self.on_chunk is not None:
                self.on_chunk(data["chunk"] - 1, data["latency_s"])

    @property
    def seconds(self) -> list:
        return [seconds for _, seconds, _ in self.chunks]

    def __enter__(self):
        from comfyui_fastar.nodes import progress

        self._send, progress.send_event = progress.send_event, self
        return self

    def __exit__(self, *exc) -> None:
        from comfyui_fastar.nodes import progress

        progress.send_event = self._send


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
