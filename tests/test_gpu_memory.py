"""On a GPU, a finished or cancelled rollout leaves no device memory behind (skipped without CUDA)."""
import gc

import pytest
import torch

from comfyui_fastar.fastar import AnnConfig, CacheConfig, Rollout, TempCacheConfig
from comfyui_fastar.fastar.models import build_model

pytestmark = pytest.mark.cuda


class Cancel(Exception):
    pass


@pytest.mark.parametrize("cache,ann", [
    (CacheConfig("unbounded"), None),
    (CacheConfig("window", 1, 2), None),
    (TempCacheConfig(max_cache_frames=4, sink_frames=1), None),
    (CacheConfig("unbounded"), AnnConfig(bits=4, probes=1, annca=True)),
])
@pytest.mark.parametrize("cancel", [False, True])
def test_rollout_returns_device_memory(cache, ann, cancel):
    model = build_model("tiny", device="cuda", seed=0)
    ctx = torch.randn(2, 5, model.context_dim, device="cuda")
    # a first run creates what lives for the process (cuBLAS workspaces, also the CUDA graph capture
    # stream's, kernel caches): not ours
    Rollout(model, ctx, frames=12, height=64, width=96, chunk_frames=3, cache=cache, ann=ann).run()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()

    def on_chunk(report):
        if cancel and report.chunk == 1:
            raise Cancel

    run = Rollout(model, ctx, frames=12, height=64, width=96, chunk_frames=3, cache=cache, ann=ann)
    try:
        out = run.run(on_chunk)
        assert torch.isfinite(out).all()
        del out
    except Cancel:
        assert cancel
    del run
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
