"""The cached chunk-wise rollout computes exactly what a full-sequence forward with the
equivalent block-causal (or sink + window) mask computes."""
import pytest
import torch

from comfyui_fastar.fastar import (AnnConfig, CacheConfig, FastARAttention, FastARError, FlowMatchSchedule, Rollout,
                                   TempCacheConfig, rollout)
from comfyui_fastar.fastar.history import History
from comfyui_fastar.fastar.rollout import CleanPasses
from comfyui_fastar.fastar.rollout import pad_context
from comfyui_fastar.fastar.models import build_model

H, W = 64, 96            # pixels -> 8x12 latent -> 4x6 = 24 tokens per frame
TPF = 24


def frame_visibility(num_frames: int, chunk_frames: int, sink_frames: int | None = None,
                     window_frames: int | None = None) -> torch.Tensor:
    """Which key frame each query frame sees in a chunked causal rollout: bool [F, F]. A frame
    sees every frame of its own chunk and of earlier chunks; with a window only the first
    ``sink_frames`` frames and the last ``window_frames`` frames before its chunk."""
    f = torch.arange(num_frames)
    start = f // chunk_frames * chunk_frames  # first frame of each frame's chunk
    visible = f[None, :] < start[:, None] + chunk_frames
    if window_frames is not None:
        visible &= (f[None, :] < (sink_frames or 0)) | (f[None, :] >= start[:, None] - window_frames)
    return visible


def block_causal_mask(num_frames: int, chunk_frames: int, tokens_per_frame: int,
                      sink_frames: int | None = None, window_frames: int | None = None) -> torch.Tensor:
    """Token-level mask [L, L] of a full-sequence forward that equals the cached rollout."""
    vis = frame_visibility(num_frames, chunk_frames, sink_frames, window_frames)
    return vis.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Recorder:
    """A ChunkModel that forwards to a Wan model and records every call."""

    def __init__(self, model):
        self.model = model
        self.calls = []
        self.cache = None
        for name in ("num_layers", "num_heads", "head_dim", "latent_channels", "context_dim", "patch_size", "dtype"):
            setattr(self, name, getattr(model, name))

    def __call__(self, x, t, context, *, frame_offset, attention):
        out = self.model(x, t, context, frame_offset=frame_offset, attention=attention)
        self.cache = attention.cache
        self.calls.append(dict(x=x.clone(), t=t.clone(), offset=frame_offset, out=out.clone()))
        return out


class Masked(FastARAttention):
    """A full-sequence forward's attention under a token mask [L, L] (True: attended), no cache: the
    reference a cached rollout must equal."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def self_attention(self, layer, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), attn_mask=self.mask)
        return out.transpose(1, 2)


class KVTap(Masked):
    """Masked attention that keeps each layer's K/V."""

    def __init__(self, mask):
        super().__init__(mask)
        self.kv = {}

    def self_attention(self, layer, q, k, v):
        self.kv[layer] = (k, v)
        return super().self_attention(layer, q, k, v)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny", seed=1)


def check_against_full_sequence(model, chunk_frames, num_chunks, cache, sink=None, window=None):
    frames = chunk_frames * num_chunks
    ctx = torch.randn(1, 7, model.context_dim)
    rec = Recorder(model)
    schedule = FlowMatchSchedule()
    latents = rollout(rec, ctx, frames=frames, height=H, width=W, chunk_frames=chunk_frames,
                      schedule=schedule, cache=cache, seed=3)
    steps = len(schedule.sigmas())
    assert len(rec.calls) == num_chunks * (steps + 1)
    mask = block_causal_mask(frames, chunk_frames, TPF, sink, window)

    # Clean pass: the whole generated video at t=0 through one masked forward.
    tap = KVTap(mask)
    full = model(latents, torch.zeros(1), ctx, attention=tap)
    for c in range(num_chunks):
        call = rec.calls[c * (steps + 1) + steps]
        assert call["offset"] == c * chunk_frames
        torch.testing.assert_close(call["x"], latents[:, :, c * chunk_frames:(c + 1) * chunk_frames])
        assert rel(call["out"], full[:, :, c * chunk_frames:(c + 1) * chunk_frames]) <= 1e-5

    # Cached K/V: every slot holds exactly the K/V of the last frame the policy put there.
    kv = rec.cache
    checked = 0
    for slot, g in {kv.frame_slot(g): g for g in range(kv.frames_cached)}.items():
        tok, ref = slice(slot * TPF, (slot + 1) * TPF), slice(g * TPF, (g + 1) * TPF)
        for layer in range(model.num_layers):
            assert rel(kv.k[layer, :, tok], tap.kv[layer][0][:, ref]) <= 1e-5
            assert rel(kv.v[layer, :, tok], tap.kv[layer][1][:, ref]) <= 1e-5
        checked += 1
    assert checked == kv.frames_held

    # Denoising steps: clean history at t=0 + the noisy chunk at its timestep, per-frame t.
    for c in range(num_chunks):
        n = (c + 1) * chunk_frames
        for s in range(steps):
            call = rec.calls[c * (steps + 1) + s]
            x = torch.cat([latents[:, :, :c * chunk_frames], call["x"]], dim=2)
            t = torch.cat([torch.zeros(c * chunk_frames), call["t"].expand(chunk_frames)])[None]
            out = model(x, t, ctx, attention=Masked(mask[:n * TPF, :n * TPF]))
            assert rel(call["out"], out[:, :, c * chunk_frames:]) <= 1e-5
    return rec


@pytest.mark.parametrize("chunk_frames,num_chunks", [(1, 6), (3, 4)])
def test_unbounded_rollout_equals_block_causal_forward(model, chunk_frames, num_chunks):
    rec = check_against_full_sequence(model, chunk_frames, num_chunks, CacheConfig("unbounded"))
    assert rec.cache.frames_held == chunk_frames * num_chunks


@pytest.mark.parametrize("chunk_frames,num_chunks,sink,window", [(1, 7, 1, 2), (3, 5, 1, 4), (3, 5, 3, 3)])
def test_window_rollout_equals_sink_window_forward(model, chunk_frames, num_chunks, sink, window):
    rec = check_against_full_sequence(model, chunk_frames, num_chunks, CacheConfig("window", sink, window),
                                      sink, window)
    kv = rec.cache
    assert kv.capacity_frames == sink + window + chunk_frames
    assert kv.frames_held == sink + window


def test_window_memory_stops_growing(model):
    ctx = torch.randn(1, 5, model.context_dim)
    cfg = CacheConfig("window", sink_frames=1, window_frames=3)
    seen = []
    rollout(model, ctx, frames=10, height=H, width=W, chunk_frames=1, cache=cfg,
            on_chunk=lambda r: seen.append(r.cache))
    held = [s.tokens_held for s in seen]
    assert held == [TPF * n for n in (1, 2, 3, 4, 4, 4, 4, 4, 4, 4)]
    assert len({s.bytes for s in seen}) == 1 and len({s.capacity_tokens for s in seen}) == 1
    assert seen[0].capacity_tokens == (1 + 3 + 1) * TPF
    assert [s.dense_tokens for s in seen] == [TPF * n for n in range(1, 11)]


def test_chunk_reports_carry_annsa_density(model, twins):
    """With AnnSA each report carries the share of the keys its clean-pass plans read; without, None."""
    ctx = torch.randn(1, 5, model.context_dim)
    settings = dict(frames=6, height=H, width=W, chunk_frames=1, cache=TempCacheConfig(max_cache_frames=4, sink_frames=1))
    sparse, dense = [], []
    rollout(model, ctx, ann=AnnConfig(keep_fraction=0.1, keep_mass=0.0, block_q=64), **settings,
            on_chunk=lambda r: sparse.append(r.annsa_density))
    rollout(model, ctx, **settings, on_chunk=lambda r: dense.append(r.annsa_density))
    assert dense == [None] * 6
    assert all(0 < d <= 1 for d in sparse) and min(sparse) < 1


def test_window_keeps_older_frames_out(model):
    """A bounded rollout differs from the unbounded one once frames leave the window."""
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(frames=6, height=H, width=W, chunk_frames=1, seed=2)
    full = rollout(model, ctx, cache=CacheConfig("unbounded"), **kw)
    win = rollout(model, ctx, cache=CacheConfig("window", 0, 2), **kw)
    torch.testing.assert_close(full[:, :, :3], win[:, :, :3], rtol=0, atol=0)
    assert rel(win[:, :, 3:], full[:, :, 3:]) > 1e-6


@pytest.mark.parametrize("cache", [CacheConfig(), TempCacheConfig(max_cache_frames=3, sink_frames=1)],
                         ids=["unbounded", "tempcache"])
def test_clean_pass_that_stops_at_the_last_kv_changes_nothing(model, cache):
    """The clean pass's output is never read, so the model stops once the last layer's K/V are in
    the cache: latents and every cached K/V equal those of a clean pass run to the end (a
    ChunkModel without ``fills_cache``), guided or not."""
    ctx, neg = torch.randn(1, 5, model.context_dim), torch.randn(1, 5, model.context_dim)
    for guide in ({}, {"negative_context": neg, "cfg": 2.0}):
        kw = dict(frames=6, height=H, width=W, chunk_frames=2, cache=cache, seed=5, **guide)
        short, full = Rollout(model, ctx, **kw), Rollout(Recorder(model), ctx, **kw)
        assert torch.equal(short.run(), full.run())
        a, b = short.cache, full.cache
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        if a.has_bias:
            assert torch.equal(a.log_count_bias, b.log_count_bias)
        assert len(full.model.calls) == 3 * (len(short.sigmas) + 1)  # the clean pass ran to the end there


class CopiedKV(FastARAttention):
    """No cache rows offered: the model makes K/V in fresh tensors and ``attend`` copies them in."""

    def kv_rows(self, layer):
        return None


class WhereKV(FastARAttention):
    """Records whether each self-attention call's K/V already are the cache's rows."""

    def __init__(self, cache, ann=None):
        super().__init__(cache, ann=ann)
        self.in_place = []

    def self_attention(self, layer, q, k, v):
        k_rows, v_rows = self.cache.rows(layer)
        self.in_place.append((k.data_ptr() == k_rows.data_ptr(), v.data_ptr() == v_rows.data_ptr()))
        return super().self_attention(layer, q, k, v)


@pytest.mark.parametrize("cache", [CacheConfig(), TempCacheConfig(max_cache_frames=4, sink_frames=1)],
                         ids=["unbounded", "tempcache"])
def test_kv_computed_in_the_cache_rows_equal_kv_copied_there(model, cache, twins):
    """The model computes k and v straight into the cache's rows of the open chunk (no copy per
    forward): latents and every cached K/V equal those of K/V copied in by ``attend``. Guided
    (two batches) the v rows are not one block, and v alone is copied."""
    ctx, neg = torch.randn(1, 5, model.context_dim), torch.randn(1, 5, model.context_dim)
    ann = AnnConfig(dense_steps_fraction=0.0)
    for guide, want in (({}, (True, True)), ({"negative_context": neg, "cfg": 2.0}, (True, False))):
        kw = dict(frames=8, height=H, width=W, chunk_frames=2, cache=cache, seed=4, ann=ann, **guide)
        direct, copied = Rollout(model, ctx, **kw), Rollout(model, ctx, **kw)
        direct.attention, copied.attention = WhereKV(direct.cache, ann), CopiedKV(copied.cache, ann=ann)
        assert torch.equal(direct.run(), copied.run())
        assert torch.equal(direct.cache.k, copied.cache.k) and torch.equal(direct.cache.v, copied.cache.v)
        assert set(direct.attention.in_place) == {want}


def test_a_rollout_makes_the_text_projections_once(model, monkeypatch):
    """The text conditions every forward of a rollout: its cross-attention K/V are made in the
    first and kept (rollouts equal full-sequence forwards, which make their own: above)."""
    made = []
    real = model.cross_kv
    monkeypatch.setattr(model, "cross_kv", lambda context: made.append(context) or real(context))
    run = Rollout(model, torch.randn(1, 5, model.context_dim), frames=6, height=H, width=W, chunk_frames=2, seed=2)
    run.run()
    assert len(made) == 1 and made[0] is run.context


def test_kept_text_projections_follow_the_context():
    """Made again for another tensor, for the same one written in place, by another maker (one
    state serving two models), and every time for an inference tensor (it counts no writes)."""
    made = []

    def make(context):
        made.append(context)
        return [(context * 2, context * 3)]

    attention, ctx = FastARAttention(), torch.randn(1, 5, 8)
    first = attention.of_context(ctx, make)
    assert attention.of_context(ctx, make) is first and len(made) == 1
    ctx.add_(1.0)
    assert torch.equal(attention.of_context(ctx, make)[0][0], ctx * 2) and len(made) == 2
    attention.of_context(ctx.clone(), make)
    assert len(made) == 3
    other = []
    attention.of_context(ctx, lambda context: other.append(context) or [(context, context)])
    assert len(other) == 1
    attention.of_context(ctx, make)
    assert len(made) == 4
    with torch.inference_mode():
        frozen = torch.randn(1, 5, 8)
        attention.of_context(frozen, make)
        attention.of_context(frozen, make)
    assert len(made) == 6


def test_fill_cache_outside_a_clean_pass_names_the_problem(model):
    attention = FastARAttention()
    with pytest.raises(FastARError, match="clean pass"):
        attention.fill_cache(0, *(torch.zeros(1, 4, 2, 8) for _ in range(3)))


def test_same_seed_same_latents_and_shared_prefix(model):
    ctx = torch.randn(1, 5, model.context_dim)
    kw = dict(height=H, width=W, chunk_frames=3)
    a = rollout(model, ctx, frames=9, seed=11, **kw)
    b = rollout(model, ctx, frames=9, seed=11, **kw)
    longer = rollout(model, ctx, frames=15, seed=11, **kw)
    other = rollout(model, ctx, frames=9, seed=12, **kw)
    assert torch.equal(a, b)
    assert torch.equal(longer[:, :, :9], a)
    assert not torch.allclose(other, a)


def test_classifier_free_guidance(model):
    """cfg batches both branches over one cache; cfg=1 with a negative is the plain run."""
    ctx, neg = torch.randn(1, model.context_len, model.context_dim), torch.randn(1, model.context_len, model.context_dim)
    kw = dict(frames=4, height=H, width=W, chunk_frames=2, seed=1)
    plain = rollout(model, ctx, **kw)
    guided = rollout(model, ctx, negative_context=neg, cfg=3.0, **kw)
    assert guided.shape == plain.shape and torch.isfinite(guided).all()
    assert rel(guided, plain) > 1e-4
    with pytest.raises(FastARError, match="negative context"):
        rollout(model, ctx, cfg=3.0, **kw)


def test_warped_schedule():
    sig = FlowMatchSchedule().sigmas()
    assert sig == pytest.approx([1.0, 0.9375, 2.5 / 3, 0.625])
    assert FlowMatchSchedule.parse("1000, 500", warp=False).sigmas() == [1.0, 0.5]


@pytest.mark.parametrize("kwargs,message", [
    (dict(frames=10, chunk_frames=3), "frames=10 is not divisible by chunk_frames=3"),
    (dict(height=100), "height=100 must be a positive multiple of 16"),
    (dict(width=72), "width=72 must be a positive multiple of 16"),
    (dict(context=torch.randn(1, 5, 31)), r"context must be \[B, tokens, 32\]"),
    (dict(context=torch.randn(5, 32)), r"context must be \[B, tokens, 32\]"),
    (dict(context_noise=-1.0), "context_noise"),
    (dict(frames=0), "frames must be a positive integer"),
])
def test_bad_rollout_inputs_name_the_problem(model, kwargs, message):
    args = dict(context=torch.randn(1, 5, model.context_dim), frames=6, height=H, width=W, chunk_frames=3)
    args.update(kwargs)
    context = args.pop("context")
    with pytest.raises(FastARError, match=message):
        rollout(model, context, **args)


@pytest.mark.parametrize("make,message", [
    (lambda: CacheConfig("ring"), "CacheConfig.mode 'ring' is unknown; expected one of unbounded, window"),
    (lambda: CacheConfig("window", sink_frames=-1), "sink_frames"),
    (lambda: CacheConfig("window", window_frames=0), "window_frames"),
    (lambda: FlowMatchSchedule((500, 750)), "strictly decreasing"),
    (lambda: FlowMatchSchedule((1200,)), r"\(0, 1000\]"),
    (lambda: FlowMatchSchedule.parse("1000,abc"), "comma-separated"),
])
def test_bad_settings_name_the_field(make, message):
    with pytest.raises(FastARError, match=message):
        make()


def test_frame_offset_as_a_tensor_gives_the_same_forward(model):
    """A CUDA graph of a forward reads the chunk's first frame from a tensor: same RoPE, same output."""
    x = torch.randn(1, 16, 2, 8, 12, generator=torch.Generator().manual_seed(5))
    ctx = torch.randn(1, 7, model.context_dim, generator=torch.Generator().manual_seed(6))
    t = torch.full((1,), 500.0)
    as_int = model(x, t, ctx, frame_offset=7)
    as_tensor = model(x, t, ctx, frame_offset=torch.tensor(7.0, dtype=torch.float64))
    assert torch.equal(as_int, as_tensor)
    assert not torch.equal(as_int, model(x, t, ctx, frame_offset=8))


def _chunk_keys(model, chunks, **settings):
    """The attention state's graph key at the start of each chunk of a rollout."""
    ctx = torch.randn(1, 7, model.context_dim, generator=torch.Generator().manual_seed(8))
    run = Rollout(model, ctx, frames=chunks, height=H, width=W, chunk_frames=1,
                  schedule=FlowMatchSchedule((1000.0, 500.0)), **settings)
    keys, reps = [], []
    for c in range(chunks):
        run.cache.begin_chunk(c, 1)
        keys.append(run.attention.graph_key())
        run.sample_chunk(c)
        run.cache.commit()
        if run.attention.annsa is not None:
            reps.append([t.data_ptr() for t in run.attention.annsa.reps[0]])
    return keys, reps


def test_graph_keys_repeat_once_the_cache_is_steady(model):
    """Chunks may replay a CUDA graph only where the previous chunk launched the same work:
    TempCache from its budget on (AnnSA's block means then updated in place), a window cache once
    full, an unbounded cache never."""
    keys, reps = _chunk_keys(model, 7, cache=TempCacheConfig(max_cache_frames=3, sink_frames=1),
                             ann=AnnConfig(keep_fraction=0.5, keep_mass=0.0, dense_steps_fraction=0.5))
    assert keys[0] != keys[1]                # the sink frame's chunk writes no history
    assert len(set(keys[1:])) == 1
    assert all(r == reps[0] for r in reps)     # the same buffers, rewritten every chunk
    keys, _ = _chunk_keys(model, 6, cache=CacheConfig("window", 1, 2))
    assert len(set(keys)) == 4 and len(set(keys[3:])) == 1
    keys, _ = _chunk_keys(model, 5, cache=CacheConfig("unbounded"))
    assert len(set(keys)) == 5


def test_rollout_pads_the_prompt_to_the_models_text_length(model):
    """Wan attends the zero rows umT5's features are padded with: a short prompt is padded as Wan pads it."""
    ctx = torch.randn(1, 12, model.context_dim, generator=torch.Generator().manual_seed(2))
    padded = torch.nn.functional.pad(ctx, (0, 0, 0, model.context_len - 12))
    settings = dict(frames=2, height=H, width=W, chunk_frames=1, seed=4)
    short = rollout(model, ctx, **settings)
    assert torch.equal(short, rollout(model, padded, **settings))
    unpadded = Rollout(model, ctx, **settings).run()
    assert rel(unpadded, short) > 1e-5  # the padding rows change the flow
    with pytest.raises(FastARError, match="the prompt has 513 tokens; this model takes at most 512"):
        rollout(model, torch.randn(1, 513, model.context_dim), **settings)


CACHES = [CacheConfig("unbounded"), CacheConfig("window", sink_frames=1, window_frames=2),
          TempCacheConfig(max_cache_frames=4, sink_frames=1, merge_threshold=0.5)]


@pytest.mark.parametrize("cache", CACHES, ids=["unbounded", "window", "tempcache"])
def test_a_prompt_switch_keeps_the_frames_before_it_and_re_encodes_the_history(model, cache):
    """Before the switch the frames are the first prompt's, bit for bit; a switch to the same prompt
    re-encodes the history into the cache it replaced, so the video is unchanged; to another prompt,
    the later chunks follow it over a history encoded with it (a fresh cache given the same frames
    at the switch)."""
    ctx, other = (pad_context(torch.randn(1, 7, model.context_dim), model.context_len) for _ in range(2))
    kw = dict(frames=6, height=H, width=W, chunk_frames=1, cache=cache, seed=3)
    plain = rollout(model, ctx, **kw)
    far = rollout(model, other, **kw)
    assert torch.equal(rollout(model, ctx, prompts=[], **kw), plain)
    assert rel(rollout(model, ctx, prompts=[(3, ctx.clone())], **kw), plain) < 1e-6
    reports = []
    out = rollout(model, ctx, prompts=[(3, other)], on_chunk=reports.append, **kw)
    assert torch.equal(out[:, :, :3], plain[:, :, :3])
    # the later chunks move to the new prompt: as far from the first prompt's as a prompt changes them
    assert rel(out[:, :, 3:], plain[:, :, 3:]) > 0.3 * rel(far[:, :, 3:], plain[:, :, 3:]) > 0
    assert [r.prompt for r in reports] == [0, 0, 0, 1, 1, 1]
    # the history at the switch: what a rollout conditioned on the new prompt throughout would cache
    # from the same frames, so chunk 3 equals a fresh rollout's given that cache
    fresh = Rollout(model, other, **kw)
    fresh.switch_prompt(other, 3, lambda a, b: out[:, :, a:b])
    fresh.cache.begin_chunk(3, 1)
    assert torch.equal(fresh.sample_chunk(3), out[:, :, 3:4])


@pytest.mark.parametrize("cache", CACHES, ids=["unbounded", "window", "tempcache"])
def test_a_rollout_that_keeps_no_video_makes_the_same_chunks_and_holds_only_what_a_switch_re_encodes(model, cache,
                                                                                                     monkeypatch):
    """``run(keep=False)``: the chunks (switches included) are those of a rollout that keeps every frame,
    the last one is returned, and the frames held stay as many however long the video: the sink's chunks and
    the cache's recent reach while a switch is ahead, none after the last; every frame for the unbounded
    cache until its last switch."""
    ctx, other = (pad_context(torch.randn(1, 7, model.context_dim), model.context_len) for _ in range(2))
    held = []
    real_add = History.add

    def add(history, start, x0):
        real_add(history, start, x0)
        held.append(sum(t.shape[2] for t in history.held.values()))

    for frames in (12, 24):
        kw = dict(frames=frames, height=H, width=W, chunk_frames=1, cache=cache, seed=3,
                  prompts=[(4, other), (frames - 2, ctx)])
        kept, streamed = [], []
        out = Rollout(model, ctx, **kw).run(lambda r: kept.append(r.latent))
        held.clear()
        with monkeypatch.context() as m:
            m.setattr(History, "add", add)
            last = Rollout(model, ctx, **kw).run(lambda r: streamed.append(r.latent), keep=False)
        assert torch.equal(torch.cat(streamed, 2), out) and torch.equal(torch.cat(kept, 2), out)
        assert torch.equal(last, out[:, :, -1:])
        assert held[-1] == 0  # no switch ahead
        if cache.history_frames is None:
            assert held[frames - 3] == frames - 2  # every frame, up to the last switch
        else:  # the sink's frame and the recent reach (whole chunks of 1): the same at both lengths
            assert max(held) <= cache.sink_frames + cache.history_frames + 1, held


@pytest.mark.parametrize("cache, encoded", [
    (CacheConfig("window", sink_frames=1, window_frames=2), [0, 1, 6, 7]),  # the sink's chunk, the last 2 frames
    (TempCacheConfig(max_cache_frames=4, sink_frames=1, merge_threshold=0.5), [0, 1, 4, 5, 6, 7]),
    (CacheConfig("unbounded"), list(range(8))),
], ids=["window", "tempcache", "unbounded"])
def test_a_switch_re_encodes_only_what_the_cache_reaches(model, cache, encoded):
    """A bounded cache re-encodes its sink's chunks and its most recent frames' (whole chunks), the
    same count however long the video; the chunks after the switch are those a fresh cache of the same
    policy, given just those frames at their positions, leads to."""
    ctx, other = (pad_context(torch.randn(1, 7, model.context_dim), model.context_len) for _ in range(2))
    kw = dict(frames=10, height=H, width=W, chunk_frames=2, cache=cache, seed=3)
    run = Rollout(model, ctx, prompts=[(4, other)], **kw)
    offsets = []
    fill = run.fill_cache
    run.fill_cache = lambda x0, offset: (offsets.append(int(offset)), fill(x0, offset))[1]
    out = run.run()
    switch = offsets[4:-1]  # chunks 0-3's clean passes, then the switch's, then chunk 4's
    assert [f + i for f in switch for i in range(2)] == encoded
    sink, recent = Rollout(model, ctx, **{**kw, "frames": 400}).recache_chunks(398)  # after 199 chunks
    if cache.history_frames is None:
        assert (sink, recent) == (range(199), range(199, 199))
    else:
        assert sink == range(1) and recent.stop == 199 and 2 * len(recent) == len(encoded) - 2

    # the reference: a fresh cache of the same policy given the same frames through the cache protocol
    ref = Rollout(model, other, **kw)
    passes = CleanPasses(ref)
    passes.run(out[:, :, :2], 0)
    if encoded[2] > 2:
        ref.cache.skip_to(encoded[2])
    passes.run(out[:, :, encoded[2]:8], encoded[2])
    ref.cache.begin_chunk(8, 2)
    assert torch.equal(ref.sample_chunk(4), out[:, :, 8:10])


def test_a_switch_works_with_guidance_and_annsa(model):
    ctx, neg, other = (pad_context(torch.randn(1, 7, model.context_dim), model.context_len) for _ in range(3))
    kw = dict(frames=6, height=H, width=W, chunk_frames=1, seed=3, cfg=2.0, negative_context=neg,
              cache=TempCacheConfig(max_cache_frames=4, sink_frames=1, merge_threshold=0.5),
              ann=AnnConfig(keep_fraction=0.5))
    plain = rollout(model, ctx, **kw)
    assert rel(rollout(model, ctx, prompts=[(2, ctx.clone())], **kw), plain) < 1e-5
    out = rollout(model, ctx, prompts=[(2, other), (4, ctx)], **kw)
    far = rollout(model, other, **kw)
    assert torch.equal(out[:, :, :2], plain[:, :, :2])
    assert rel(out[:, :, 2:4], plain[:, :, 2:4]) > 0.3 * rel(far[:, :, 2:4], plain[:, :, 2:4]) > 0


@pytest.mark.parametrize("prompts, message", [
    ([(0, None)], "prompt switch 1 is at chunk 0; switches must fall strictly after"),
    ([(3, None), (3, None)], "prompt switch 2 is at chunk 3"),
    ([(6, None)], "inside the rollout's 6 chunks"),
    ([(2, "short")], r"prompt switch 1's context \(1, 5, 32\) must match the first prompt's \(1, 7, 32\)"),
])
def test_bad_prompt_switches_name_the_problem(model, prompts, message):
    ctx = torch.randn(1, 7, model.context_dim)
    texts = {None: ctx, "short": torch.randn(1, 5, model.context_dim)}
    with pytest.raises(FastARError, match=message):
        Rollout(model, ctx, frames=6, height=H, width=W, chunk_frames=1,
                prompts=[(c, texts[t]) for c, t in prompts])


@pytest.mark.parametrize("cache", CACHES, ids=["unbounded", "window", "tempcache"])
def test_a_start_latent_is_cached_first_and_the_chunks_follow_it(model, cache):
    """Image-to-video: the start latent's frame is the video's first, cached by a clean pass before the
    first chunk (as core ComfyUI seeds its cache), and the chunks follow from frame 1: chunk 0 equals a
    rollout's chunk over a cache that was given that frame; another start image changes the video."""
    ctx = pad_context(torch.randn(1, 7, model.context_dim), model.context_len)
    g = torch.Generator().manual_seed(5)
    start = torch.randn(1, model.latent_channels, 1, H // 8, W // 8, generator=g)
    kw = dict(frames=7, height=H, width=W, chunk_frames=2, cache=cache, seed=3)
    out = rollout(model, ctx, start=start, **kw)
    assert out.shape[2] == 7 and torch.equal(out[:, :, :1], start)
    ref = Rollout(model, ctx, start=start, **kw)
    ref.cache.begin_chunk(0, 1)
    ref.attention.begin_clean_pass()
    ref.fill_cache(start, 0)
    ref.cache.commit()
    ref.cache.begin_chunk(1, 2)
    assert torch.equal(ref.sample_chunk(0), out[:, :, 1:3])
    other = rollout(model, ctx, start=torch.randn(start.shape, generator=g), **kw)
    assert rel(other[:, :, 1:], out[:, :, 1:]) > 1e-4  # (the tiny random model leans little on its history)
    # a prompt switch re-encodes the start frame too: switching to the same prompt while every frame is in
    # the cache's reach changes nothing
    assert rel(rollout(model, ctx, start=start, prompts=[(1, ctx.clone())], **kw), out) < 1e-6


@pytest.mark.parametrize("start, frames, message", [
    ((1, 16, 0, 8, 12), 9, r"start latent must be \[B, 16, frames, 8, 12\]"),
    ((1, 16, 4, 8, 12), 9, r"frames=9 after the start latent's 4 is not a whole number of chunks"),
    ((1, 16, 1, 4, 12), 9, r"start latent must be"),
    ((1, 16, 1, 8, 12), 8, r"frames=8 after the start latent's 1 is not a whole number of chunks"),
    ((2, 16, 1, 8, 12), 9, r"start latent's batch 2 must match the context's 1"),
])
def test_a_bad_start_latent_names_the_problem(model, start, frames, message):
    ctx = pad_context(torch.randn(1, 7, model.context_dim), model.context_len)
    with pytest.raises(FastARError, match=message):
        Rollout(model, ctx, frames=frames, height=H, width=W, chunk_frames=2, start=torch.zeros(start))


def test_a_rollout_left_to_its_default_cache_keeps_its_memory_bounded():
    """``Rollout`` without ``cache=`` holds TempCache's budget (12 frames, the CLI's and the nodes' default),
    allocated once: flat however long the video, where every frame kept grows with it."""
    model = build_model("tiny", seed=3)
    ctx = torch.randn(1, 8, model.context_dim, generator=torch.Generator().manual_seed(1))

    def cache_sizes(**cache):
        seen = []
        Rollout(model, ctx, frames=60, height=H, width=W, chunk_frames=3, **cache).run(
            lambda r: seen.append((r.cache.tokens_held, r.cache.bytes)))
        return seen

    default, every = cache_sizes(), cache_sizes(cache=CacheConfig("unbounded"))
    budget = TempCacheConfig().max_cache_frames * TPF
    assert max(t for t, _ in default) <= budget and default[-1][0] == budget
    assert len({b for _, b in default}) == 1                 # allocated once, at the budget
    assert every[-1][0] == 60 * TPF and every[-1][1] > 3 * default[-1][1]  # 60 frames' K/V against 12 + merge state
