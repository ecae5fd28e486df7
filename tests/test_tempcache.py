"""TempCache: exact log-count merging (Lemma 5.1), bit-exact no-merge path, hard budget."""
import pytest
import torch

from comfyui_fastar.fastar import (CacheConfig, FastARError, Rollout, TempCacheConfig, attend, make_cache,
                                   rollout)
from comfyui_fastar.fastar.models import build_model
from comfyui_fastar.testing.backends import fold_forced

TPF, H, D = 6, 2, 16


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cache(cfg, chunk_frames=1):
    return make_cache(cfg, num_layers=1, batch=1, num_heads=H, head_dim=D, tokens_per_frame=TPF,
                   chunk_frames=chunk_frames)


def write_chunk(kv, k, v):
    kv.begin_chunk(kv.frames_cached, k.shape[1] // TPF)
    kv.begin_clean_pass()
    kv.attend(0, k, v)
    kv.write_history(0, k)
    kv.commit()


def test_lemma_5_1_duplicated_keys_merge_exactly():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, TPF, H, D, generator=g)
    fresh = torch.randn(1, TPF, H, D, generator=g)
    # frames: base, base, [half base | half fresh], base  (values always new)
    frames_k = [base, base.clone(), torch.cat([base[:, :TPF // 2], fresh[:, TPF // 2:]], 1), base.clone()]
    frames_v = [torch.randn(1, TPF, H, D, generator=g) for _ in frames_k]
    kv = cache(TempCacheConfig(merge_threshold=0.999, max_cache_frames=6, sink_frames=0))
    for k, v in zip(frames_k, frames_v):
        write_chunk(kv, k, v)
    st = kv.stats()
    # 24 tokens written, 6 + 3 distinct keys survive: 15 merged
    assert st.tokens_held == TPF + TPF // 2
    counts = kv._count[0, 0]
    assert sorted(counts[counts > 0].flatten().tolist()) == sorted(([4.0] * (TPF // 2) + [3.0] * (TPF // 2)
                                                                    + [1.0] * (TPF // 2)) * H)
    # attention of a new chunk over the merged cache (+log m) == over every token unmerged
    q = torch.randn(1, 2 * TPF, H, D, generator=g)
    own_k, own_v = torch.randn(1, TPF, H, D, generator=g), torch.randn(1, TPF, H, D, generator=g)
    kv.begin_chunk(kv.frames_cached, 1)
    keys, values, bias = kv.attend(0, own_k, own_v)
    merged = attend(q, keys, values, key_bias=bias)
    full = attend(q, torch.cat(frames_k + [own_k], 1), torch.cat(frames_v + [own_v], 1))
    assert rel(merged, full) <= 1e-5
    assert torch.isfinite(merged).all()


def test_tokens_of_one_chunk_merging_into_one_slot_average_exactly():
    """Two frames of one chunk repeat the held frame: each slot then takes two tokens in one write,
    and holds the mean of all three values (and the representative's key) with count 3."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(1, TPF, H, D, generator=g)
    vals = [torch.randn(1, TPF, H, D, generator=g) for _ in range(3)]
    kv = cache(TempCacheConfig(merge_threshold=0.999, max_cache_frames=4, sink_frames=0),
               chunk_frames=2)
    seen = {}
    kv.observer = lambda layer, b, slots: seen.__setitem__((layer, b), slots.clone())
    write_chunk(kv, base, vals[0])
    write_chunk(kv, torch.cat([base, base], 1), torch.cat(vals[1:], 1))
    count = kv._count[0, 0]
    assert sorted(count[count > 0].flatten().tolist()) == [3.0] * (TPF * H)
    slots = seen[0, 0][:, :TPF]  # [H, TPF] slot of each token of the first repeat
    first = kv.history.start  # history slot 0's row
    for head in range(H):
        rows = first + slots[head]
        got_v = kv.v[0, 0, rows, head]
        assert rel(got_v, sum(v[0, :, head] for v in vals) / 3) <= 1e-6
        assert torch.equal(kv.k[0, 0, rows, head], base[0, :, head])


def test_unclearable_threshold_is_bit_identical_to_plain_cache():
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=8, height=64, width=96, chunk_frames=1, seed=4)
    runs = {}
    for name, cfg in [("plain", TempCacheConfig(enabled=False, max_cache_frames=5, sink_frames=1)),
                      ("strict", TempCacheConfig(merge_threshold=1.0, max_cache_frames=5, sink_frames=1))]:
        run = Rollout(model, ctx, cache=cfg, **kw)
        runs[name] = (run.run(), run.cache)
    (a, ca), (b, cb) = runs["plain"], runs["strict"]
    assert torch.equal(a, b)
    assert torch.equal(ca.k, cb.k) and torch.equal(ca.v, cb.v)
    assert torch.equal(ca.log_count_bias, cb.log_count_bias)
    assert torch.equal(ca._count, cb._count) and cb._merged.sum() == 0


def test_no_merge_budget_equals_sink_window_cache():
    """Without merges, evicting the least recently refreshed tokens keeps the newest frames:
    the same attention as the sink + window cache (and as unbounded while the budget holds)."""
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=9, height=64, width=96, chunk_frames=3, seed=5)
    budget = rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=7, sink_frames=1), **kw)
    window = rollout(model, ctx, cache=CacheConfig("window", sink_frames=1, window_frames=6), **kw)
    assert rel(budget, window) <= 1e-5
    roomy = rollout(model, ctx, cache=TempCacheConfig(enabled=False, max_cache_frames=12, sink_frames=2), **kw)
    dense = rollout(model, ctx, cache=CacheConfig("unbounded"), **kw)
    assert rel(roomy, dense) <= 1e-5


def test_budget_holds_over_long_rollout_without_reallocation():
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    cfg = TempCacheConfig(merge_threshold=0.6, max_cache_frames=5, sink_frames=1)
    run = Rollout(model, ctx, frames=60, height=64, width=96, chunk_frames=1, cache=cfg, seed=1)
    tpf = 24
    buffers = (run.cache.k.data_ptr(), run.cache.v.data_ptr(), run.cache.log_count_bias.data_ptr(),
               run.cache._count.data_ptr())
    seen = []

    def check(report):
        kv = run.cache
        assert (kv.k.data_ptr(), kv.v.data_ptr(), kv.log_count_bias.data_ptr(),
                kv._count.data_ptr()) == buffers
        assert report.cache.tokens_held <= cfg.max_cache_frames * tpf
        seen.append(report.cache)

    out = run.run(check)
    assert torch.isfinite(out).all() and len(seen) == 60
    assert len({s.bytes for s in seen}) == 1
    assert seen[-1].tokens_held == cfg.max_cache_frames * tpf  # full budget
    assert sum(s.merged for s in seen) > 0 and sum(s.evicted for s in seen) > 0
    assert seen[-1].dense_tokens == 60 * tpf


def test_sink_frames_are_never_merged():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, TPF, H, D, generator=g)
    kv = cache(TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1))
    for _ in range(4):
        write_chunk(kv, base.clone(), torch.randn(1, TPF, H, D, generator=g))
    assert torch.equal(kv.k[0, :, :TPF], base)  # the sink frame is kept as written
    assert (kv.log_count_bias[0, :, :, :TPF] == 0).all()
    assert kv._count[0, 0].max() == 3  # frames 2..4 merged into the history copy of frame 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(merge_threshold=0.0), "merge_threshold"),
    (dict(merge_threshold=1.5), "merge_threshold"),
    (dict(max_cache_frames=3, sink_frames=3), "max_cache_frames"),
    (dict(sink_frames=-1), "sink_frames"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(FastARError, match=f"TempCacheConfig.{field}"):
        TempCacheConfig(**kwargs)


def test_budget_must_hold_a_chunk():
    with pytest.raises(FastARError, match="max_cache_frames 4 leaves 1 frame of history"):
        cache(TempCacheConfig(max_cache_frames=4, sink_frames=3), chunk_frames=3)


def test_the_observer_sees_each_token_join_its_group():
    """``TempCache.observer`` gets each merge's slots: distinct slots for a first frame, and the same slots
    again for its repeat (every duplicate joined its original's group)."""
    g = torch.Generator().manual_seed(6)
    base = torch.randn(1, TPF, H, D, generator=g)
    kv = cache(TempCacheConfig(merge_threshold=0.999, max_cache_frames=3, sink_frames=0))
    seen = []
    kv.observer = lambda layer, b, slots: seen.append((layer, b, slots.clone()))
    write_chunk(kv, base, torch.randn(1, TPF, H, D, generator=g))
    (layer, b, first), = seen
    assert (layer, b) == (0, 0) and first.shape == (H, TPF)
    assert (first >= 0).all() and all(len(set(row.tolist())) == TPF for row in first)
    write_chunk(kv, base.clone(), torch.randn(1, TPF, H, D, generator=g))
    assert torch.equal(seen[-1][2], first)


def test_write_path_never_syncs_with_the_host(monkeypatch):
    """The per-layer merge runs on the device: no .item(), .tolist(), .cpu() or bool() of a tensor."""
    g = torch.Generator().manual_seed(8)
    kv = cache(TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1))
    base = torch.randn(1, TPF, H, D, generator=g)
    frames = [base + 0.2 * torch.randn(1, TPF, H, D, generator=g) for _ in range(5)]

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in the TempCache write path")
    for name in ("item", "tolist", "cpu", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for k in frames:
        kv.begin_chunk(kv.frames_cached, 1)
        kv.begin_clean_pass()
        kv.attend(0, k, k)
        kv.write_history(0, k)
        kv.commit()
    monkeypatch.undo()
    assert kv.stats().merged > 0


@pytest.mark.parametrize("sink_frames,chunk_frames", [(1, 1), (3, 2), (0, 2)])
def test_bias_is_zero_outside_the_bias_window(sink_frames, chunk_frames):
    """What AnnSA's kernel relies on when it skips the bias: at every forward of every chunk,
    the keys outside ``Layout.bias`` (a committed sink, the open chunk) have bias exactly 0,
    and a sink still empty lies inside the window (its slots are -inf); once it is committed,
    the sink and the open chunk are the one span ``Layout.fixed`` before the window."""
    kv = cache(TempCacheConfig(merge_threshold=0.5, max_cache_frames=sink_frames + 4, sink_frames=sink_frames),
               chunk_frames=chunk_frames)
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1, chunk_frames * TPF, H, D, generator=gen)  # a static scene: keys merge
    merged = 0
    for _ in range(8):
        kv.begin_chunk(kv.frames_cached, chunk_frames)
        for clean in (False, True):
            if clean:
                kv.begin_clean_pass()
            k = base + 0.2 * torch.randn(base.shape, generator=gen)
            _, _, bias = kv.attend(0, k, torch.randn_like(k))
            lo, hi = kv.layout.bias
            assert bool((bias[..., :lo] == 0).all()) and bool((bias[..., hi:] == 0).all())
            assert hi == bias.shape[-1] == kv.history.stop
            fixed = kv.layout.fixed
            if kv.frames_cached < sink_frames:
                assert lo == 0 and bool(torch.isneginf(bias[..., kv.frames_cached * TPF:sink_frames * TPF]).all())
                assert fixed is None
            else:
                assert fixed == slice(0, lo) and lo == kv.layout.chunk.stop
            if clean:
                kv.write_history(0, k)
                merged += int(kv._merged.sum())
        kv.commit()
    assert merged > 0  # the window held log m > 0 too


def test_a_short_chunk_attends_no_stale_scratch_rows():
    """A chunk shorter than chunk_frames leaves scratch rows between it and the history, holding an
    earlier chunk's K/V: they are empty (-inf) and inside the bias window, so attention over
    ``attend``'s keys equals attention without them; the next full chunk's rows are unbiased again."""
    g = torch.Generator().manual_seed(3)
    kv = cache(TempCacheConfig(merge_threshold=0.5, max_cache_frames=7, sink_frames=1), chunk_frames=3)
    for n in (3, 3, 1, 3):
        kv.begin_chunk(kv.frames_cached, n)
        k, v, q = (torch.randn(1, n * TPF, H, D, generator=g) for _ in range(3))
        keys, values, bias = kv.attend(0, k, v)
        chunk, hist = kv.layout.chunk, kv.history
        gap = slice(chunk.stop, hist.start)
        lo, hi = kv.layout.bias
        committed = kv.frames_cached >= 1  # the sink
        assert kv.layout.fixed == (slice(0, chunk.stop) if committed else None) and hi == keys.shape[1]
        assert lo == (chunk.stop if committed else 0)
        assert gap.stop - gap.start == (3 - n) * TPF and bool(torch.isneginf(bias[..., gap]).all())
        assert bool((bias[..., :lo] == 0).all())
        kept = torch.cat([torch.arange(gap.start), torch.arange(gap.stop, keys.shape[1])])
        got = attend(q, keys, values, key_bias=bias)
        want = attend(q, keys[:, kept], values[:, kept], key_bias=bias[..., kept])
        assert rel(got, want) <= 1e-6
        kv.begin_clean_pass()
        kv.attend(0, k, v)
        kv.write_history(0, k)
        kv.commit()


@pytest.mark.parametrize("sink_frames,chunk_frames", [(1, 1), (2, 2), (0, 2)])
def test_folded_keys_carry_the_bias_every_call_applies(monkeypatch, sink_frames, chunk_frames):
    """At every forward of every chunk (merges, AnnSA-style row permutations and a short chunk
    included) the cache's folded keys are the per-call fold of ``attend``'s keys and bias over the
    layout's bias window, and the cache's K, V and bias equal an unfolded cache's fed alike."""
    from comfyui_fastar.kernels import flash4
    fold_forced(monkeypatch)
    cfg = TempCacheConfig(merge_threshold=0.5, max_cache_frames=sink_frames + 4, sink_frames=sink_frames)
    folded = cache(cfg, chunk_frames=chunk_frames)
    monkeypatch.undo()
    plain = cache(cfg, chunk_frames=chunk_frames)
    assert folded.backend.key_pad == flash4.KEY_PAD and plain.backend.key_pad == 0
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(1, chunk_frames * TPF, H, D, generator=gen)
    for i in range(9):
        frames = 1 if i == 6 else chunk_frames
        for kv in (folded, plain):
            kv.begin_chunk(kv.frames_cached, frames)
        for clean in (False, True):
            k = base[:, :frames * TPF] + 0.2 * torch.randn(1, frames * TPF, H, D, generator=gen)
            v = torch.randn_like(k)
            for kv in (plain, folded):
                if clean:
                    kv.begin_clean_pass()
                keys, values, bias = kv.attend(0, k, v)  # the folded cache's last
            want = flash4.fold_bias_into_keys(k, keys, bias, folded.layout.bias)[1]
            assert torch.equal(folded.backend.folded_keys(keys), want)
            assert folded.k.data_ptr() == folded.backend.folded_keys(keys).data_ptr()
            if clean:
                for kv in (folded, plain):
                    kv.write_history(0, k)
                perm = torch.stack([torch.randperm(folded.history.stop - folded.history.start, generator=gen)
                                    for _ in range(H)])[None]
                for kv in (folded, plain):
                    kv.sort_history(0, perm)
                keys, _, bias = folded.attend(0, k, v)
                assert torch.equal(folded.backend.folded_keys(keys),
                                   flash4.fold_bias_into_keys(k, keys, bias, folded.layout.bias)[1])
        for kv in (folded, plain):
            kv.commit()
        assert torch.equal(folded.k, plain.k) and torch.equal(folded.v, plain.v)
        assert torch.equal(folded.log_count_bias, plain.log_count_bias)
    assert int(folded._count.max()) > 1  # keys merged: log m > 0 was folded


def test_folded_rollout_equals_the_unfolded_one(monkeypatch):
    """The folded layout changes where keys lie, not what is computed: a TempCache + AnnSA rollout
    (the model writing its keys into the folded rows) is bit-identical to the unfolded one."""
    from comfyui_fastar.fastar import AnnConfig
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=9, height=64, width=96, chunk_frames=3, seed=4,
              cache=TempCacheConfig(merge_threshold=0.5, max_cache_frames=6, sink_frames=1), ann=AnnConfig())
    plain = Rollout(model, ctx, **kw)
    fold_forced(monkeypatch)
    folded = Rollout(model, ctx, **kw)
    assert folded.cache.backend.key_pad and not plain.cache.backend.key_pad
    assert torch.equal(folded.run(), plain.run())
    assert torch.equal(folded.cache.k, plain.cache.k) and int(folded.cache._count.max()) > 1
