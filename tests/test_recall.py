"""Recall, TempCache's memory tier: what it archives, what it reads back, and that attention over the
budget and the recalled frames is attention over the frames they hold."""
import pytest
import torch

from comfyui_fastar.fastar import AnnConfig, CacheConfig, Rollout, TempCacheConfig
from comfyui_fastar.fastar.config import check_settings
from comfyui_fastar.fastar.errors import SettingError
from comfyui_fastar.fastar.models import build_model
from comfyui_fastar.fastar.recall import Recall


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_budget_and_every_recalled_frame_attend_as_the_dense_cache():
    """Without merges TempCache's budget holds the newest frames; recall rows enough for every older one
    hold the rest: the rollout is the unbounded cache's, and the archive every frame past the sink."""
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=15, height=64, width=96, chunk_frames=3, seed=5)
    recall = Rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=7, sink_frames=1,
                                                       recall_frames=8), **kw)
    with torch.inference_mode():
        recalled = recall.run()
        dense = Rollout(model, ctx, cache=CacheConfig("unbounded"), **kw).run()
        budget = Rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=7, sink_frames=1), **kw).run()
    assert rel(recalled, dense) <= 1e-5 < rel(budget, dense)
    stats, tier = recall.cache.stats(), recall.cache.recall
    assert tier.archived == 14 and stats.host_bytes == 14 * tier.bytes_per_frame
    assert stats.recalled == 8 * recall.cache.tokens_per_frame  # frames 1..8: older than the budget's 6


def test_each_layer_recalls_the_frames_its_queries_favour():
    """Among archived frames, the one whose keys lie along a layer's queries is that layer's first choice;
    frames inside the budget (the newest ``before``) are never chosen; chosen again, a frame keeps its slot."""
    g = torch.Generator().manual_seed(0)
    tier = Recall(2, num_layers=2, batch=1, num_heads=2, head_dim=8, tokens_per_frame=4, chunk_frames=1,
                  device="cpu", dtype=torch.float32)
    keys = torch.randn(2, 1, 6 * 4, 2, 8, generator=g) * 0.1
    q = torch.randn(2, 1, 4, 2, 8, generator=g)
    keys[0, :, 4 * 4:5 * 4] = 3 * q[0]  # layer 0 looks at frame 4, layer 1 at frame 1
    keys[1, :, 1 * 4:2 * 4] = 3 * q[1]
    tier.archive(keys, torch.randn(keys.shape, generator=g))
    for layer in range(2):
        tier.note_queries(layer, q[layer])
    chosen = tier.choose(6)
    assert chosen[0, 0, 0] == 4 and chosen[1, 0, 0] == 1
    assert 4 not in tier.choose(4)[0, 0].tolist()
    k = torch.zeros(2, 1, 2 * 4, 2, 8)
    v, bias = torch.zeros_like(k), torch.full((2, 1, 2, 8), float("-inf"))
    tier.fill(k, v, bias, slice(0, 8), chosen)
    slot = tier.held[0, 0].tolist().index(4)
    assert torch.equal(k[0, 0, slot * 4:(slot + 1) * 4], keys[0, 0, 16:20]) and (bias == 0).all()
    tier.fill(k, v, bias, slice(0, 8), chosen.flip(-1))
    assert tier.held[0, 0].tolist().index(4) == slot


def test_a_memory_tier_is_a_setting_checked_with_the_rest():
    with pytest.raises(SettingError, match="recall_frames"):
        TempCacheConfig(recall_frames=-1)
    with pytest.raises(SettingError, match="AnnSA's plans do not read"):
        check_settings(TempCacheConfig(max_cache_frames=21, recall_frames=6), AnnConfig(), 3)


def test_head_parallelism_refuses_a_memory_tier():
    """Each rank holds some heads; its choice of frames would be its heads' alone."""
    from comfyui_fastar.fastar.errors import FastARError
    from comfyui_fastar.fastar.parallel import HeadParallelTempCache

    with pytest.raises(FastARError, match="recall_frames runs in one process"):
        HeadParallelTempCache(TempCacheConfig(recall_frames=2), parallel=None, num_layers=1, batch=1, num_heads=2,
                              head_dim=8, tokens_per_frame=4, chunk_frames=1)
