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
    hold the rest: the rollout is the unbounded cache's, and the archive every frame past the sink. The
    last chunk reads all 8 recall rows filled, in one dense span with the sink and itself (on a GPU: cuDNN
    beside the biased kernel)."""
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=18, height=64, width=96, chunk_frames=3, seed=5)
    recall = Rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=7, sink_frames=1,
                                                       recall_frames=8), **kw)
    layouts, begin = [], recall.cache._begin
    recall.cache._begin = lambda frames: layouts.append(begin(frames)) or layouts[-1]
    with torch.inference_mode():
        recalled = recall.run()
        dense = Rollout(model, ctx, cache=CacheConfig("unbounded"), **kw).run()
        budget = Rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=7, sink_frames=1), **kw).run()
    assert rel(recalled, dense) <= 1e-5 < rel(budget, dense)
    cache = recall.cache
    assert [l.fixed.stop for l in layouts[-2:]] == [cache.recall_rows.start, cache.recall_rows.stop]
    stats, tier = cache.stats(), cache.recall
    assert tier.archived == 17 and stats.host_bytes == 17 * tier.bytes_per_frame
    assert stats.recalled == 8 * cache.tokens_per_frame


def _committed(tier, keys, q, layers=2, t=4):
    """Commit ``keys`` [L, 1, frames * t, H, D] a frame at a time (the queries ``q`` noted each time) through
    a cache of the tier's recall rows [0, rt) and an open chunk's rows [rt, (r + 1)t); yields (k, v, bias)
    after each."""
    r = tier.frames
    k = torch.zeros(layers, 1, (r + 1) * t, *keys.shape[-2:])
    v, bias = torch.zeros_like(k), torch.full((layers, 1, keys.shape[-2], (r + 1) * t), float("-inf"))
    for f in range(keys.shape[2] // t):
        k[:, :, r * t:] = keys[:, :, f * t:(f + 1) * t]
        v[:, :, r * t:] = -keys[:, :, f * t:(f + 1) * t]
        for layer in range(layers):
            tier.note_queries(layer, q[layer])
        tier.commit(k, v, slice(0, r * t), bias, slice(r * t, (r + 1) * t))
        yield k, v, bias


def test_each_layer_recalls_the_frames_its_queries_favour():
    """Among archived frames, the one whose keys lie along a layer's queries is that layer's; the recall rows
    take it two commits after the queries that chose it, and never a frame the budget still holds then; chosen
    again, a frame keeps its slot."""
    g = torch.Generator().manual_seed(0)
    tier = Recall(2, num_layers=2, batch=1, num_heads=2, head_dim=8, tokens_per_frame=4, chunk_frames=1,
                  history_frames=2, device="cpu", dtype=torch.float32)
    keys = torch.randn(2, 1, 9 * 4, 2, 8, generator=g) * 0.1
    q = torch.randn(2, 1, 4, 2, 8, generator=g)
    keys[0, :, 4 * 4:5 * 4] = 3 * q[0]  # layer 0 looks at frame 4, layer 1 at frame 1
    keys[1, :, 1 * 4:2 * 4] = 3 * q[1]
    slots = []
    for n, (k, v, bias) in enumerate(_committed(tier, keys, q), 1):
        # after n commits the next chunk holds the newest 2 frames of n in its budget: recall only older ones
        assert all(f < n - 2 for f in tier.held.flatten().tolist() if f >= 0)
        if n >= 4 + 3:  # frame 4 is older than the budget from commit 7 on, and chosen then
            slot = tier.held[0, 0].tolist().index(4)
            assert torch.equal(k[0, 0, slot * 4:(slot + 1) * 4], keys[0, 0, 16:20])
            assert torch.equal(v[0, 0, slot * 4:(slot + 1) * 4], -keys[0, 0, 16:20])
            slots.append(slot)
        if n >= 1 + 3:
            assert 1 in tier.held[1, 0].tolist()
    assert len(slots) == 3 and len(set(slots)) == 1 and (bias[..., :8] == 0).all()
    assert tier.archived == 9


def test_a_full_archive_thins_its_oldest_frames():
    """Past its capacity the archive drops frames, the far past ever more sparsely: what it holds stays
    within the capacity, the first and the newest frames kept, the gaps growing with age."""
    tier = Recall(1, num_layers=1, batch=1, num_heads=1, head_dim=4, tokens_per_frame=4, chunk_frames=1,
                  history_frames=1, device="cpu", dtype=torch.float32, archive_bytes=1)
    assert tier.capacity == 3  # the least: twice the recall rows and a chunk
    tier = Recall(1, num_layers=1, batch=1, num_heads=1, head_dim=4, tokens_per_frame=4, chunk_frames=1,
                  history_frames=1, device="cpu", dtype=torch.float32, archive_bytes=8 * 2 * 4 * 4 * 4)
    assert tier.capacity == 8 and tier.bytes_per_frame == 2 * 4 * 4 * 4
    keys, held = torch.randn(1, 1, 40 * 4, 1, 4), {}
    for _ in _committed(tier, keys, torch.randn(1, 1, 4, 1, 4), layers=1):
        assert tier.archived <= 8
        tier._worker.drain()  # the host's copies, made beside the next chunk
        assert len(tier._host) <= 8
        held.update({id(t): t for t in tier._host.values()})
    assert sorted(tier._host) == [0, 16, 24, 32, 36, 37, 38, 39]
    assert len(held) <= 9  # a thinned frame's host memory holds a later one: none allocated once full
    for f, t in tier._host.items():
        assert torch.equal(t[0, 0, 0], keys[0, 0, f * 4:(f + 1) * 4])


def test_a_dropped_tier_ends_its_worker_and_frees_its_archive():
    """The worker holds no job once done, so a tier nobody holds is freed and its thread ends (a rollout's
    cache rebuilt for each run would otherwise keep every old archive)."""
    import gc
    import threading
    import weakref

    tier = Recall(1, num_layers=1, batch=1, num_heads=1, head_dim=4, tokens_per_frame=4, chunk_frames=1,
                  history_frames=1, device="cpu", dtype=torch.float32)
    for _ in _committed(tier, torch.randn(1, 1, 5 * 4, 1, 4), torch.randn(1, 1, 4, 1, 4), layers=1):
        pass
    tier._worker.drain()
    gone, thread = weakref.ref(tier), tier._worker.thread
    del tier, _
    gc.collect()
    thread.join(5)
    assert gone() is None and not thread.is_alive()


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
