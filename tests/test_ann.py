"""AnnSA / AnnCA: dense when every block is selected, sparse and sync-free otherwise.

The sparse paths run the block-sparse kernel under Triton's interpreter (small sizes)."""
import pytest
import torch

from comfyui_fastar.fastar import (AnnConfig, CacheConfig, FastARAttention, FastARError, FlowMatchSchedule, Rollout,
                                   TempCacheConfig, attend, make_cache as new_cache, pad_context, rollout)
from comfyui_fastar.fastar import annsa as annsa_mod, attention as attention_mod, backend as backend_mod
from comfyui_fastar.fastar.annsa import KEY_BLOCK, AnnSA
from comfyui_fastar.fastar.attention import build_ann
from comfyui_fastar.fastar.lsh import LSH
from comfyui_fastar.fastar.models import build_model
from comfyui_fastar.testing.annsa import plan_density, recall

B, H, D, TPF, CF = 1, 2, 32, 40, 2
HISTORY_RATIO = annsa_mod.MIN_HISTORY_RATIO  # the rule's own value (conftest sets it to 0 for the rest)
# every history block (AnnSA) and every prompt token (AnnCA: one bit, flipped by its probe): density 1
ALL = AnnConfig(bits=1, probes=1, keep_fraction=1.0, keep_mass=0.0, dense_steps_fraction=0.0, min_tokens=0, annca=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kwargs, field", [
    (dict(bits=0), "bits"), (dict(bits=13), "bits"),
    (dict(probes=9), "probes"), (dict(probes=-1), "probes"), (dict(block_q=32), "block_q"),
    (dict(dense_steps_fraction=1.5), "dense_steps_fraction"), (dict(dense_layers=(-1,)), "dense_layers"),
    (dict(dense_layers=3), "dense_layers"), (dict(annsa=1), "annsa"), (dict(annca="yes"), "annca"),
    (dict(min_tokens=-2), "min_tokens"), (dict(seed=1.5), "seed"), (dict(bits=True), "bits"),
    (dict(keep_fraction=0.0), "keep_fraction"), (dict(keep_mass=1.5), "keep_mass"),
    (dict(keep_mass=-0.1), "keep_mass"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(FastARError, match=f"AnnConfig.{field}"):
        AnnConfig(**kwargs)


def test_config_schedule():
    cfg = AnnConfig(dense_steps_fraction=0.3, dense_layers=[1])
    assert cfg.dense_layers == (1,)
    assert [cfg.sparse_at(0, s, 4) for s in range(5)] == [False, True, True, True, True]
    assert not cfg.sparse_at(1, 3, 4) and cfg.sparse_at(0, None, None)
    assert not AnnConfig(dense_steps_fraction=1.0).sparse_at(0, 4, 4)  # clean pass dense too


def test_lsh_deterministic_for_a_seed():
    x = torch.randn(1, 50, 2, 32)
    a = LSH(8, 2, num_layers=2, num_heads=2, head_dim=32, seed=7, device="cpu")
    b = LSH(8, 2, num_layers=2, num_heads=2, head_dim=32, seed=7, device="cpu")
    c = LSH(8, 2, num_layers=2, num_heads=2, head_dim=32, seed=8, device="cpu")
    assert torch.equal(a.hash(a.planes[1], x), b.hash(b.planes[1], x))
    assert not torch.equal(a.hash(a.planes[1], x), c.hash(c.planes[1], x))
    assert torch.equal(a.probe_codes(a.planes[0], x), b.probe_codes(b.planes[0], x))
    assert a.hash(a.planes[0], x).max() < 256 and a.hash(a.planes[0], x).min() >= 0
    # a query's probes differ from its own bucket in exactly one bit
    pc = a.probe_codes(a.planes[0], x)
    flips = pc[..., 1:] ^ pc[..., :1]
    assert ((flips & (flips - 1)) == 0).all() and (flips > 0).all()


def make_cache(config, layers=1, dtype=torch.float32, tpf=TPF, device="cpu"):
    return new_cache(config, num_layers=layers, batch=B, num_heads=H, head_dim=D, tokens_per_frame=tpf,
                     chunk_frames=CF, max_frames=12, dtype=dtype, device=device)


def clustered(n, centers, noise=0.05, gen=None):
    """Tokens near a few directions, in runs of 16-80 neighbouring tokens (a frame's regions, each
    head its own): the structure ANN exploits."""
    pick = torch.empty(B, n, H, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            i = 0
            while i < n:
                run = int(torch.randint(16, 81, (), generator=gen))
                pick[b, i:i + run, h] = int(torch.randint(0, centers.shape[0], (), generator=gen))
                i += run
    return centers[pick, torch.arange(H)] + noise * torch.randn(B, n, H, D, generator=gen)


def fill(attn, chunks, gen, centers=None):
    """Run ``chunks`` chunks of one denoising forward + clean pass through layer 0; returns the
    last chunk's (q, k, v) and the (dense, via attention) output of its final denoising call."""
    cache = attn.cache
    for c in range(chunks):
        cache.begin_chunk(c * CF, CF)
        n = CF * cache.tokens_per_frame
        make = (lambda: clustered(n, centers, gen=gen)) if centers is not None else (
            lambda: torch.randn(B, n, H, D, generator=gen))
        q, k, v = (t.to(cache.device, cache.dtype) for t in (make(), make(), torch.randn(B, n, H, D, generator=gen)))
        attn.step = 3
        attn.self_attention(0, q, k, v)
        cache.begin_clean_pass()
        attn.step = 4
        attn.self_attention(0, q, k, v)
        cache.commit()
    cache.begin_chunk(chunks * CF, CF)
    return (t.to(cache.device, cache.dtype) for t in (make(), make(), torch.randn(B, n, H, D, generator=gen)))


QUANT_ALL = AnnConfig(keep_fraction=1.0, keep_mass=0.0, dense_steps_fraction=0.0)
TOP_P_ALL = AnnConfig(keep_fraction=0.01, keep_mass=1.0, dense_steps_fraction=0.0)


@pytest.mark.parametrize("cfg", [QUANT_ALL, TOP_P_ALL], ids=["fraction", "top-p"])
@pytest.mark.parametrize("cache_cfg", [CacheConfig(), TempCacheConfig(max_cache_frames=6, sink_frames=2)],
                         ids=["unbounded", "tempcache"])
def test_annsa_every_bucket_equals_dense(cache_cfg, cfg):
    gen = torch.Generator().manual_seed(0)
    sparse = FastARAttention(make_cache(cache_cfg), ann=cfg)
    dense = FastARAttention(make_cache(cache_cfg))
    g2 = torch.Generator().manual_seed(0)
    q, k, v = fill(sparse, 4, gen)
    fill(dense, 4, g2)
    sparse.step = dense.step = 3
    out = sparse.self_attention(0, q, k, v)
    ref = dense.self_attention(0, q, k, v)
    assert rel(out, ref) <= 1e-5
    # the history was really reordered (not a no-op): same key set, different order
    rows = sparse.cache.layout.history
    ks, kd = sparse.cache.k[0, :, rows], dense.cache.k[0, :, rows]
    assert not torch.equal(ks, kd)
    assert torch.equal(ks.sort(1).values, kd.sort(1).values)


@pytest.mark.parametrize("cache_cfg", [CacheConfig(), TempCacheConfig(max_cache_frames=10, sink_frames=2)],
                         ids=["unbounded", "tempcache"])
def test_top_p_reads_what_the_mass_needs(cache_cfg, twins):
    """Diffuse attention (random q and k): top-p reads most history blocks and keeps about
    keep_mass of the mass; queries matching their own chunk's keys, which are alike within each
    block of 128 (a smooth region): it reads only its floor."""
    cfg = AnnConfig(keep_fraction=0.1, keep_mass=0.95, dense_steps_fraction=0.0)
    attn = FastARAttention(make_cache(cache_cfg, tpf=2 * KEY_BLOCK), ann=cfg)
    gen = torch.Generator().manual_seed(2)
    q, k, v = fill(attn, 4, gen)
    keys, _, bias = attn.cache.attend(0, k, v)
    held = (attn.annsa.reps[0][3]).sum(-1).float()  # history blocks holding keys [B, H]

    def picked(plan):  # history blocks read per query block, as a share of the held ones
        ranges, counts = plan
        used = torch.arange(ranges.shape[-2]) < counts[..., None]
        inside = ((ranges[..., 1] - ranges[..., 0]) * used)[..., 2:].sum(-1)
        return (inside / KEY_BLOCK).ceil() / held[..., None]

    diffuse = attn.annsa.plan(0, q)
    assert picked(diffuse).mean() > 0.6
    assert recall(attn.annsa, q, keys, bias, diffuse, sample_blocks=100, history_only=True).item() > 0.9
    n = k.shape[1]
    region = torch.randn(B, n // KEY_BLOCK, H, D, generator=gen).repeat_interleave(KEY_BLOCK, 1) * 3
    k = region + 0.1 * torch.randn(B, n, H, D, generator=gen)
    keys, _, bias = attn.cache.attend(0, k, v)
    local = attn.annsa.plan(0, region)
    assert picked(local).max() <= 0.1 + 1 / held.min()  # the floor, runs rounded up to whole blocks
    assert recall(attn.annsa, region, keys, bias, local, sample_blocks=100).item() > 0.95


@pytest.mark.parametrize("cfg", [AnnConfig(keep_fraction=0.4, keep_mass=0.0, dense_steps_fraction=0.0),
                                 AnnConfig(keep_fraction=0.4, keep_mass=0.95, dense_steps_fraction=0.0)],
                         ids=["fraction", "top-p"])
def test_annsa_plan_is_sparse_on_structured_inputs(cfg, twins):
    gen = torch.Generator().manual_seed(1)
    centers = torch.nn.functional.normalize(torch.randn(8, H, D, generator=gen), dim=-1) * 10
    attn = FastARAttention(make_cache(CacheConfig(), tpf=2 * KEY_BLOCK), ann=cfg)  # 16 quant blocks
    q, k, v = fill(attn, 4, gen, centers)
    keys, values, bias = attn.cache.attend(0, k, v)
    ranges, counts = attn.annsa.plan(0, q)
    density = plan_density(ranges, counts, keys.shape[1]).item()
    assert 0.2 < density < 0.6  # own chunk alone is 0.2
    assert attn.annsa.density[0].item() == pytest.approx(density)  # the telemetry the plan wrote as it went
    # the planned sparse attention still finds most of the dense attention mass
    assert recall(attn.annsa, q, keys, bias, (ranges, counts), sample_blocks=100).item() > 0.95
    out = attn.annsa.attention(0, q, keys, values, bias)
    ref = attend(q, keys, values)
    assert rel(out, ref) < 0.15
    # every used range is in bounds
    used = torch.arange(ranges.shape[-2]) < counts[..., None]
    assert (ranges[..., 1][used] <= keys.shape[1]).all() and (ranges[..., 0][used] <= ranges[..., 1][used]).all()


def test_default_plan_holds_both_extremes_the_fixed_share_fails_one(twins):
    """Why top-p over a floor is the default: on diffuse attention (random q, k) a fixed share of
    blocks keeps about that share of the mass, while top-p reads what the mass needs; on sharply
    clustered keys, where mean keys undercount mixed blocks, the 0.2 floor keeps most of it."""
    def kept(cfg, centers, seed):
        gen = torch.Generator().manual_seed(seed)
        attn = FastARAttention(make_cache(CacheConfig(), tpf=2 * KEY_BLOCK), ann=cfg)
        q, k, v = fill(attn, 4, gen, centers)
        keys, _, bias = attn.cache.attend(0, k, v)
        return recall(attn.annsa, q, keys, bias, attn.annsa.plan(0, q), sample_blocks=100).item()

    gen = torch.Generator().manual_seed(1)
    centers = torch.nn.functional.normalize(torch.randn(8, H, D, generator=gen), dim=-1) * 10
    default = AnnConfig(dense_steps_fraction=0.0)
    fixed = AnnConfig(keep_fraction=0.35, keep_mass=0.0, dense_steps_fraction=0.0)
    assert (default.keep_fraction, default.keep_mass) == (0.2, 0.95)
    assert kept(default, None, 2) > 0.93 and kept(fixed, None, 2) < 0.6
    assert kept(default, centers, 1) > 0.85 and kept(fixed, centers, 1) > 0.95


def test_annca_all_kept_equals_dense_and_floor_applies():
    gen = torch.Generator().manual_seed(2)
    cache = make_cache(CacheConfig())
    q = torch.randn(B, CF * TPF, H, D, generator=gen)
    k, v = torch.randn(B, 23, H, D, generator=gen), torch.randn(B, 23, H, D, generator=gen)
    _, annca = build_ann(ALL, cache)
    assert annca.keep(0, q, k).all()
    assert rel(annca.attention(0, q, k, v), attend(q, k, v)) <= 1e-5
    _, floor = build_ann(AnnConfig(bits=8, probes=0, min_tokens=23, annca=True), cache)  # floor = every token
    assert rel(floor.attention(0, q, k, v), attend(q, k, v)) <= 1e-5
    _, sparse = build_ann(AnnConfig(bits=8, probes=0, min_tokens=5, annca=True), cache)
    keep = sparse.keep(0, q, k)
    assert (keep.sum(-1) >= 5).all() and keep.float().mean() < 1
    # equals dense attention over each frame's kept tokens (a -inf mask)
    out = sparse.attention(0, q, k, v)
    for f in range(CF):
        rows = slice(f * TPF, (f + 1) * TPF)
        for h in range(H):
            kk = keep[0, h, f]
            ref = attend(q[:, rows, h:h + 1], k[:, kk, h:h + 1], v[:, kk, h:h + 1])
            assert rel(out[:, rows, h:h + 1], ref) <= 1e-5


def test_window_cache_refuses_annsa():
    with pytest.raises(FastARError, match="window"):
        FastARAttention(make_cache(CacheConfig(mode="window")), ann=AnnConfig())
    FastARAttention(make_cache(CacheConfig(mode="window")), ann=AnnConfig(annsa=False))
    with pytest.raises(FastARError, match="dense_layers"):
        FastARAttention(make_cache(CacheConfig()), ann=AnnConfig(dense_layers=(5,)))
    with pytest.raises(FastARError, match="KV cache"):
        FastARAttention(ann=AnnConfig())


class NoSync:
    """Make every host-sync entry point of a tensor raise."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        for name in self.names:
            monkeypatch.setattr(torch.Tensor, name, self.boom(name))

    @staticmethod
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host sync: Tensor.{name}")
        return f


def masked_stand_in(q, k, v, ranges, counts, *, key_bias=None, block_q=64, **_):
    """Sync-free stand-in for the kernel (the twin validates on the host): dense masked SDPA."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    used = torch.arange(ranges.shape[-2]) < counts[..., None]                     # [B, H, nqb, R]
    keys = torch.arange(lk)
    inside = (keys >= ranges[..., 0, None]) & (keys < ranges[..., 1, None]) & used[..., None]
    block_mask = inside.any(-2)                                                   # [B, H, nqb, Lk]
    slot = torch.arange(lq) // block_q
    row_mask = block_mask[:, :, slot]
    bias = torch.zeros(b, h, lq, lk).masked_fill(~row_mask, float("-inf"))
    if key_bias is not None:
        bias = bias + key_bias[:, :, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("keep_mass", [0.0, 0.95], ids=["fraction", "top-p"])
def test_sparse_forward_has_no_host_sync(monkeypatch, keep_mass):
    gen = torch.Generator().manual_seed(3)
    cfg = AnnConfig(keep_mass=keep_mass, bits=4, probes=1, dense_steps_fraction=0.0, min_tokens=3, keep_fraction=0.5,
                    annca=True)
    attn = FastARAttention(make_cache(TempCacheConfig(max_cache_frames=6, sink_frames=2)), ann=cfg)
    q, k, v = fill(attn, 3, gen)
    ctx_k, ctx_v = torch.randn(B, 9, H, D), torch.randn(B, 9, H, D)
    monkeypatch.setattr(backend_mod, "block_sparse_attention_auto", masked_stand_in)  # AnnSA's calls and AnnCA's
    with monkeypatch.context() as m:
        NoSync(m)
        out = attn.self_attention(0, q, k, v)           # plan + sparse attention
        attn.cache.begin_clean_pass()
        attn.self_attention(0, q, k, v)                 # TempCache write + hashing + bucket sort
        attn.cache.commit()
        cross = attn.cross_attention(0, q, ctx_k, ctx_v)  # AnnCA selection + attention
    assert torch.isfinite(out).all() and torch.isfinite(cross).all()
    # the stand-in is the twin's semantics: same result through the twin
    monkeypatch.undo()
    attn.cache.begin_chunk(attn.cache.frames_cached, CF)
    attn.cache.attend(0, k, v)
    plan = attn.annsa.plan(0, q)
    keys, values, bias = attn.cache.attend(0, k, v)
    args = (q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), *plan)
    kw = dict(key_bias=bias, block_q=cfg.block_q)
    assert rel(masked_stand_in(*args, **kw), backend_mod.block_sparse_attention_auto(*args, **kw)) <= 1e-5


H_PX, W_PX = 64, 96  # 24 tokens per frame on the tiny model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=1)


@pytest.mark.parametrize("cache_cfg", [CacheConfig(), TempCacheConfig(max_cache_frames=8, sink_frames=1)],
                         ids=["unbounded", "tempcache"])
def test_rollout_with_ann(model, cache_cfg, monkeypatch):
    """9 chunks of one frame: the history grows to two key blocks, so a plan can leave one out."""
    ctx = pad_context(torch.randn(1, 7, model.context_dim, generator=torch.Generator().manual_seed(4)), model.context_len)
    settings = dict(frames=9, height=H_PX, width=W_PX, chunk_frames=1, cache=cache_cfg, seed=3,
                    schedule=FlowMatchSchedule((1000.0, 500.0)))
    dense = rollout(model, ctx, **settings)
    every = Rollout(model, ctx, ann=ALL, **settings)
    assert rel(every.run(), dense) <= 1e-5
    assert every.attention.annca.density.min() == 1
    assert all(r is not None for r in every.attention.annsa.reads)  # every layer's plans wrote their telemetry
    if isinstance(cache_cfg, CacheConfig):  # (TempCache's empty slots are skipped, not read)
        assert every.attention.annsa.density.min() == 1
    calls, attention = [], annsa_mod.AnnSA.attention
    monkeypatch.setattr(annsa_mod.AnnSA, "attention", lambda self, *a, **k: calls.append(1) or attention(self, *a, **k))
    monkeypatch.setattr(annsa_mod, "DENSE_ABOVE", 1.0)  # every sparse call pays: the count below is the schedule's
    densities = []
    sparse = Rollout(model, ctx, ann=AnnConfig(keep_fraction=0.2, keep_mass=0.0, min_tokens=2, dense_steps_fraction=0.5,
                                               annca=True), **settings).run(lambda r: densities.append(r.annsa_density))
    assert torch.isfinite(sparse).all()
    # 9 chunks x (1 sparse step x 2 layers + the clean pass's first layer: the last one only writes its K/V)
    assert len(calls) == 9 * (2 + 1) and min(densities) < 0.9
    # sparse, yet nearer dense than a rollout that forgets the history beyond one frame
    forgetful = rollout(model, ctx, **{**settings, "cache": CacheConfig("window", sink_frames=0, window_frames=1)})
    assert 1e-5 < rel(sparse, dense) < rel(forgetful, dense)


def test_layers_run_dense_where_sparsity_does_not_pay(model, monkeypatch):
    """A layer whose plans read more than ``DENSE_ABOVE`` of its keys runs dense two chunks later (its
    densities are read a chunk late) and from then on neither plans nor sorts its history."""
    ctx = pad_context(torch.randn(1, 7, model.context_dim, generator=torch.Generator().manual_seed(4)), model.context_len)
    settings = dict(frames=6, height=H_PX, width=W_PX, chunk_frames=1, cache=TempCacheConfig(max_cache_frames=8,
                    sink_frames=1), seed=3, schedule=FlowMatchSchedule((1000.0, 500.0)))
    cfg = AnnConfig(keep_fraction=0.2, keep_mass=0.0, min_tokens=2, dense_steps_fraction=0.0)
    calls, plans, sorts = [], [], []
    attention, plan, index = AnnSA.attention, AnnSA.plan, AnnSA.index_history
    monkeypatch.setattr(AnnSA, "attention", lambda self, *a, **k: calls.append(1) or attention(self, *a, **k))
    monkeypatch.setattr(AnnSA, "plan", lambda self, *a, **k: plans.append(1) or plan(self, *a, **k))
    monkeypatch.setattr(AnnSA, "index_history", lambda self, *a, **k: sorts.append(1) or index(self, *a, **k))
    monkeypatch.setattr(annsa_mod, "DENSE_ABOVE", -1.0)  # no plan pays
    reports = []
    r = Rollout(model, ctx, ann=cfg, **settings)
    out = r.run(reports.append)
    assert r.attention.annsa.pays == [False] * model.num_layers
    # two chunks sparse (the decision reads the densities a chunk late; 2 steps x 2 layers + the clean pass's
    # first layer: the last one only writes its K/V), each sorting both layers' histories; then nothing
    assert len(calls) == len(plans) == 2 * 5 and len(sorts) == 2 * 2
    assert [rep.annsa_sparse for rep in reports] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(out).all()
    # the same rollout with no AnnSA at all: the dense layers' attention is TempCache's own
    plain = Rollout(model, ctx, **settings).run()
    assert rel(out, plain) > 0  # the first two chunks ran sparse
    key = r.attention.graph_key()
    assert key[1][1] == tuple(r.attention.annsa.pays)  # a change of mind is a new CUDA graph
    annsa = r.attention.annsa
    monkeypatch.setattr(annsa_mod, "DENSE_ABOVE", 0.8)
    annsa.pays = [True] * model.num_layers
    annsa._decide([0.78, 0.81])
    assert annsa.pays == [True, False]
    annsa._decide([0.1, 0.1])  # once dense, dense for the rest of the rollout
    assert annsa.pays == [True, False]


def test_annsa_runs_only_where_the_history_can_pay(model, monkeypatch, caplog):
    """Where the history holds fewer than ``MIN_HISTORY_RATIO`` rows per row every call reads dense (the
    sink and the open chunk), AnnSA neither plans nor sorts, and the rollout is TempCache's alone, bit for
    bit; the unbounded cache's history grows past the ratio, and its layers turn sparse when it does."""
    ctx = pad_context(torch.randn(1, 7, model.context_dim, generator=torch.Generator().manual_seed(4)), model.context_len)
    monkeypatch.setattr(annsa_mod, "MIN_HISTORY_RATIO", HISTORY_RATIO)
    assert HISTORY_RATIO == 2.0  # the cases below are built around it
    cfg = AnnConfig(keep_fraction=0.2, keep_mass=0.0, min_tokens=2, dense_steps_fraction=0.0)
    plans, sorts = [], []
    plan, index = AnnSA.plan, AnnSA.index_history
    monkeypatch.setattr(AnnSA, "plan", lambda self, *a, **k: plans.append(1) or plan(self, *a, **k))
    monkeypatch.setattr(AnnSA, "index_history", lambda self, *a, **k: sorts.append(1) or index(self, *a, **k))
    short = dict(frames=6, height=H_PX, width=W_PX, chunk_frames=2, seed=3, schedule=FlowMatchSchedule((1000.0, 500.0)),
                 cache=TempCacheConfig(max_cache_frames=6, sink_frames=1))  # history 5 frames, dense rows 1 + 2
    reports = []
    monkeypatch.setattr(attention_mod, "_aside", set())
    with caplog.at_level("WARNING", logger=attention_mod.__name__):
        r = Rollout(model, ctx, ann=cfg, **short)
        out = r.run(reports.append)
    assert not r.attention.annsa.can_pay and plans == [] and sorts == []
    # said once, with the budget from which it would run: a history of 2 x (1 sink + 2 chunk frames) past the sink
    assert [m for m in caplog.messages if "AnnSA stands aside" in m] == [
        "FAST-AR: AnnSA stands aside: TempCache's history of 5 frames is too short against the 3 every call reads "
        "dense (the sink and the chunk) for a sparse call to pay; it runs from max_cache_frames 7 on"]
    assert all(rep.annsa_sparse == 0.0 for rep in reports)
    assert torch.equal(out, Rollout(model, ctx, **short).run())
    growing = {**short, "frames": 6, "chunk_frames": 1, "cache": CacheConfig()}
    monkeypatch.setattr(annsa_mod, "DENSE_ABOVE", 1.0)  # every plan pays: the history's length alone decides
    reports = []
    r = Rollout(model, ctx, ann=cfg, **growing)
    r.run(reports.append)
    # chunk c holds c history frames against its own one: sparse from the second chunk with history on
    assert [rep.annsa_sparse for rep in reports] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_twin_on_annsa_plans(dtype, device):
    """The plans AnnSA builds (runs of sorted key blocks, TempCache bias) mean the same to the
    Triton kernel as to its torch twin."""
    from comfyui_fastar.kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_torch
    gen = torch.Generator().manual_seed(5)
    attn = FastARAttention(make_cache(TempCacheConfig(max_cache_frames=6, sink_frames=2), dtype=dtype, device=device),
                           ann=AnnConfig(bits=5, probes=2, keep_fraction=0.5, dense_steps_fraction=0.0))
    q, k, v = fill(attn, 3, gen)
    keys, values, bias = attn.cache.attend(0, k, v)
    ranges, counts = attn.annsa.plan(0, q)
    args = (q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), ranges, counts)
    kw = dict(key_bias=bias, block_q=64)
    out, ref = block_sparse_attention(*args, **kw), block_sparse_attention_torch(*args, **kw)
    assert rel(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("cache_cfg", [CacheConfig(), TempCacheConfig(max_cache_frames=6, sink_frames=2)],
                         ids=["unbounded", "tempcache"])
def test_fixed_rows_go_through_a_prior(cache_cfg, monkeypatch, device):
    """Where the sink and the open chunk are one span (``Layout.fixed``), AnnSA attends it with
    ``attend_lse`` (cuDNN on a GPU) and only the plan's other ranges in the kernel: the same result
    as the twin on the whole plan. Before a TempCache sink is committed there is no such span."""
    calls = []
    real = backend_mod.attend_lse
    monkeypatch.setattr(backend_mod, "attend_lse", lambda *a: calls.append(a[1].shape[1]) or real(*a))
    from comfyui_fastar.kernels.block_sparse_attention import block_sparse_attention_torch
    gen = torch.Generator().manual_seed(9)
    attn = FastARAttention(make_cache(cache_cfg, device=device), ann=AnnConfig(bits=5, probes=2, keep_fraction=0.5,
                                                                                dense_steps_fraction=0.0))
    assert attn.cache.layout is None  # no chunk open
    q, k, v = fill(attn, 3, gen)
    keys, values, bias = attn.cache.attend(0, k, v)
    layout = attn.cache.layout
    fixed = layout.fixed
    ranges, counts = plan = attn.annsa.plan(0, q)
    chunk, sink = layout.chunk, layout.sink  # the plan's first two ranges
    assert [tuple(r) for r in ranges[0, 0, 0, :2].tolist()] == [(0, sink), (chunk.start, chunk.stop)]
    assert (fixed.start, fixed.stop) == ((0, chunk.stop) if sink else (chunk.start, chunk.stop))
    calls.clear()
    out = attn.annsa.attention(0, q, keys, values, bias, plan)
    ref = block_sparse_attention_torch(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), ranges,
                                       counts, key_bias=bias, block_q=64).transpose(1, 2)
    assert calls == [fixed.stop - fixed.start] and rel(out, ref) <= 1e-5
    if isinstance(cache_cfg, TempCacheConfig):
        fresh = make_cache(cache_cfg)
        # the sink's own frames: its slots are empty (-inf) until committed
        assert fresh.begin_chunk(0, CF).fixed is None


def test_recall_samples_every_block_it_is_asked_for():
    """recall() over more sample blocks than exist covers each block once (not only the first)."""
    torch.manual_seed(0)
    tpf, d = 64, 16
    kv = new_cache(CacheConfig("unbounded"), num_layers=1, batch=1, num_heads=1, head_dim=d, tokens_per_frame=tpf,
                   chunk_frames=2, max_frames=8)
    annsa, _ = build_ann(AnnConfig(bits=3, probes=0, keep_fraction=0.3, keep_mass=0.0, annca=False), kv)
    for c in range(3):
        kv.begin_chunk(2 * c, 2)
        kv.begin_clean_pass()
        k = torch.randn(1, 2 * tpf, 1, d)
        kv.attend(0, k, k)
        annsa.index_history(0)
        kv.commit()
    kv.begin_chunk(6, 2)
    keys, values, bias = kv.attend(0, torch.randn(1, 2 * tpf, 1, d), torch.randn(1, 2 * tpf, 1, d))
    q = torch.randn(1, 2 * tpf, 1, d)
    plan = annsa.plan(0, q)
    ranges, counts = plan
    assert ranges.shape[2] == 2  # two query blocks
    masses = []
    for blk in range(2):
        inside = torch.zeros(keys.shape[1], dtype=torch.bool)
        for r in range(int(counts[0, 0, blk])):
            inside[int(ranges[0, 0, blk, r, 0]):int(ranges[0, 0, blk, r, 1])] = True
        assert 0 < inside.float().mean() < 1  # the plan is sparse: a real sum over some keys
        p = torch.softmax(q[0, blk * 64:(blk + 1) * 64, 0] @ keys[0, :, 0].T / d ** 0.5, dim=-1)
        masses.append(p[:, inside].sum(-1))
    expected = torch.cat(masses).mean().item()
    assert recall(annsa, q, keys, bias, plan, sample_blocks=16).item() == pytest.approx(expected, abs=1e-5)


def test_quant_block_log_mass_counts_merged_keys():
    """A 'quant' key block weighs its keys' multiplicity: logsumexp of TempCache's log m over its
    filled keys, log(count) without TempCache, -inf when it holds no key."""
    n = KEY_BLOCK
    k = torch.randn(1, 3 * n, 1, 8)
    filled = torch.ones(1, 1, k.shape[1], dtype=torch.bool)
    filled[..., 2 * n:] = False                      # third block empty
    filled[..., n:n + 10] = False                    # second block: n - 10 keys
    log_m = torch.zeros(1, 1, k.shape[1])
    log_m[..., 0] = torch.tensor(5.0).log()          # one key merged from 5 frames
    plain = AnnSA._block_means(k, filled, None)[2]
    merged = AnnSA._block_means(k, filled, log_m)[2]
    torch.testing.assert_close(plain[0, 0, :2], torch.tensor([n, n - 10.0]).log())
    torch.testing.assert_close(merged[0, 0, :2], torch.tensor([n + 4.0, n - 10.0]).log())
    assert plain[0, 0, 2] == merged[0, 0, 2] == float("-inf")


@pytest.mark.parametrize("enabled", [True, False], ids=["merging", "eviction-only"])
def test_annsa_sort_never_changes_what_tempcache_evicts(enabled):
    """Many chunks past the budget: AnnSA at density 1 (its history re-sorted per head every
    chunk) holds the same keys as plain TempCache and attends identically: eviction ignores slot
    order, and the shared correspondence compares whole tokens across heads whatever each head's
    slot order."""
    cfg = TempCacheConfig(enabled=enabled, max_cache_frames=4, sink_frames=1, merge_threshold=0.9)
    centers = torch.randn(12, H, D, generator=torch.Generator().manual_seed(5))
    sparse = FastARAttention(make_cache(cfg), ann=ALL)
    dense = FastARAttention(make_cache(cfg))
    totals = {}  # merges and evictions over all writes (the telemetry holds the last one's)
    for name, attn in (("sparse", sparse), ("dense", dense)):
        tc, commit = attn.cache, attn.cache.commit
        totals[name] = torch.zeros(2, dtype=torch.long)
        attn.cache.commit = lambda t=totals[name], tc=tc, commit=commit: (
            t.add_(torch.stack([tc._merged.sum(), tc._evicted.sum()])), commit())
    q, k, v = fill(sparse, 6, torch.Generator().manual_seed(3), centers)
    fill(dense, 6, torch.Generator().manual_seed(3), centers)
    assert torch.equal(totals["sparse"], totals["dense"]), totals
    assert (totals["dense"][0] > 0) == enabled and totals["dense"][1] > 0
    rows = dense.cache.layout.history
    held = [c.cache.k[0, :, rows][c.cache._count[0].transpose(1, 2)[..., None].expand(-1, -1, -1, D) > 0]
            for c in (sparse, dense)]
    assert torch.equal(held[0].sort().values, held[1].sort().values)
    # the shared match's head alignment followed every sort: token i's slot holds one token in all heads
    tc = sparse.cache
    for state in (tc._count, tc._newest, tc._token):
        lined_up = state.gather(-1, tc._canon)
        assert torch.equal(lined_up, lined_up[:, :, :1].expand_as(lined_up))
    assert not torch.equal(tc._canon[:, :, 0], tc._canon[:, :, 1])  # the heads were sorted apart
    sparse.step = dense.step = 3
    assert rel(sparse.self_attention(0, q, k, v), dense.self_attention(0, q, k, v)) <= 1e-5
