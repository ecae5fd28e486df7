"""On a GPU: chunks replayed from a CUDA graph compute what eager chunks compute."""

import pytest
import torch

from comfyui_fastar.fastar import AnnConfig, CacheConfig, FastARAttention, Rollout, TempCacheConfig
from comfyui_fastar.fastar import backend as backends
from comfyui_fastar.fastar.models import build_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("cache,ann", [
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), AnnConfig(keep_fraction=0.5, keep_mass=0.0)),
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), AnnConfig(keep_fraction=0.1, keep_mass=0.9)),
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), AnnConfig(bits=4, probes=1, annca=True)),
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), None),
    (CacheConfig("window", 3, 3), None),
], ids=["tempcache+quant", "tempcache+top-p", "tempcache+quant+annca", "tempcache", "window"])
def test_graphed_chunks_equal_eager_chunks(cache, ann):
    model = build_model("tiny", device="cuda", seed=0)
    ctx = torch.randn(1, 5, model.context_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(frames=27, height=64, width=96, chunk_frames=3, cache=cache, ann=ann, cfg=3.0,
                    negative_context=torch.zeros_like(ctx), context_noise=10.0)
    eager = Rollout(model, ctx, cuda_graphs=False, **settings)
    graphed = Rollout(model, ctx, **settings)

    def clear_telemetry(engine):
        """Zero AnnSA's keys-read buffers before the last chunk: only that chunk's plans can refill them."""
        def on_chunk(r):
            if engine.attention.annsa is not None and r.chunk + 2 == r.num_chunks:
                for reads in engine.attention.annsa.reads:
                    reads.zero_()
        return on_chunk

    want, got = eager.run(clear_telemetry(eager)), graphed.run(clear_telemetry(graphed))
    assert eager.graph_replays == 0 and graphed.graph_replays >= 5  # captured by chunk 4 of 9 at the latest
    if ann is not None:  # the last chunk's replayed plans wrote AnnSA's density telemetry, as the eager ones did
        density = graphed.attention.annsa.density
        assert 0 < density.min() and density.max() <= 1
        torch.testing.assert_close(density, eager.attention.annsa.density)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    held = slice(0, graphed.cache.capacity_frames * graphed.cache.tokens_per_frame)  # not TempCache's dump row
    for a, b in ((graphed.cache.k, eager.cache.k), (graphed.cache.v, eager.cache.v)):
        torch.testing.assert_close(a[:, :, held], b[:, :, held], rtol=1e-5, atol=1e-5)  # the history the graphs wrote


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphed"])
def test_history_writes_on_a_side_stream_equal_writes_in_line(cuda_graphs, monkeypatch):
    """The clean pass's history writes (TempCache's merge, AnnSA's sort) overlapping the rest of
    the pass on a side stream leave the same outputs and cache as when they run in line."""
    model = build_model("tiny", device="cuda", seed=0)
    ctx = torch.randn(1, 5, model.context_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(frames=27, height=64, width=96, chunk_frames=3, cuda_graphs=cuda_graphs,
                    cache=TempCacheConfig(max_cache_frames=6, sink_frames=3), ann=AnnConfig(keep_fraction=0.5))
    inline, side = Rollout(model, ctx, **settings), Rollout(model, ctx, **settings)
    with monkeypatch.context() as m:  # the "side" streams are the current one: the writes run in line
        m.setattr(backends, "side_stream", lambda device, role: torch.cuda.current_stream(device))
        want = inline.run()
    got = side.run()
    assert side.cache.write_stream is None  # joined: nothing of the last chunk left running
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((side.cache.k, inline.cache.k), (side.cache.v, inline.cache.v),
                 (side.cache._count, inline.cache._count)):
        torch.testing.assert_close(a[:, :, :-1], b[:, :, :-1], rtol=1e-5, atol=1e-5)  # all but the dump row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphed"])
def test_kv_computed_in_the_cache_rows_equal_kv_copied_there(cuda_graphs, dtype):
    """On the GPU path (the q-k prologue kernel writing k into the cache's rows, addmm v): the
    rollout and its cache match those of K/V made in fresh tensors and copied in by ``attend``."""
    model = build_model("tiny", device="cuda", dtype=dtype, seed=0)
    ctx = torch.randn(1, 5, model.context_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    settings = dict(frames=27, height=64, width=96, chunk_frames=3, cuda_graphs=cuda_graphs,
                    cache=TempCacheConfig(max_cache_frames=6, sink_frames=3), ann=AnnConfig())
    direct, copied = Rollout(model, ctx, **settings), Rollout(model, ctx, **settings)
    in_place = []
    real = FastARAttention.kv_rows
    direct.attention.kv_rows = lambda layer: in_place.append(layer) or real(direct.attention, layer)
    copied.attention.kv_rows = lambda layer: None
    got, want = direct.run(), copied.run()
    assert in_place and (direct.graph_replays >= 5) == cuda_graphs
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for a, b in ((direct.cache.k, copied.cache.k), (direct.cache.v, copied.cache.v)):
        torch.testing.assert_close(a[:, :, :-1].float(), b[:, :, :-1].float(), rtol=tol, atol=tol)  # not the dump row


@pytest.mark.parametrize("cache,ann", [
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), AnnConfig(keep_fraction=0.5, keep_mass=0.0)),
    (CacheConfig("window", 3, 3), None),
], ids=["tempcache+quant", "window"])
def test_a_prompt_switch_replays_graphs_that_equal_eager_chunks(cache, ann):
    """A switch drops the chunk graph (it read the old text) and re-encodes the history, its clean
    passes replayed from a graph of their own: the video equals the eager rollout's."""
    model = build_model("tiny", device="cuda", seed=0)
    g = torch.Generator("cuda").manual_seed(1)
    ctx, other = (torch.randn(1, 5, model.context_dim, device="cuda", generator=g) for _ in range(2))
    settings = dict(frames=36, height=64, width=96, chunk_frames=3, cache=cache, ann=ann,
                    prompts=[(7, other), (10, ctx)])
    eager = Rollout(model, ctx, cuda_graphs=False, **settings)
    graphed = Rollout(model, ctx, **settings)
    want, got = eager.run(), graphed.run()
    assert graphed.graph_replays >= 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
