"""FlashAttention-4's path (kernels/flash4.py): the key bias folded into the keys gives the biased
softmax (checked with plain attention math, wherever the tests run), and on a Hopper GPU with FA4
installed its calls against fp64 math."""
import math

import pytest
import torch

from comfyui_fastar.fastar import backend as backends
from comfyui_fastar.fastar import sdpa
from comfyui_fastar.kernels import flash4
from comfyui_fastar.testing.backends import fold_forced
from comfyui_fastar.kernels.plan import range_blocks, runs_to_ranges


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def softmax_attention(q, k, v, bias=None):
    """fp64 attention of [B, L, H, D] tensors with an optional [B, H, Lk] key bias: (out, lse [B, H, Lq])."""
    logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias.double()[:, :, None]
    lse = logits.logsumexp(-1)
    return torch.einsum("bhqk,bkhd->bqhd", (logits - lse[..., None]).exp(), v.double()), lse


def inputs(lq=37, lk=150, h=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for n in (lq, lk, lk))
    bias = torch.randint(1, 6, (1, h, lk), generator=g).float().log()
    bias[..., 100:110] = float("-inf")  # empty TempCache slots
    return q, k, v, bias


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 16), (torch.bfloat16, 128), (torch.float16, 16),
                                     (torch.float16, 128)])
def test_bias_folded_into_the_keys_gives_the_biased_logits(dtype, d):
    q, k, v, bias = inputs(d=d)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    window = (20, 140)
    windowed = torch.zeros_like(bias)
    windowed[..., 20:140] = bias[..., 20:140]
    want, _ = softmax_attention(q, k, v, windowed)
    qp, kp = flash4.fold_bias_into_keys(q, k, bias, window)
    assert qp.shape[-1] == kp.shape[-1] == q.shape[-1] + 16 and kp.dtype == k.dtype
    logits = torch.einsum("bqhd,bkhd->bhqk", qp.double(), kp.double()) / math.sqrt(q.shape[-1])
    got = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v.double())
    assert kp.isfinite().all()  # fp16: an empty slot's -1e4 / scale would overflow, and hi + lo be NaN
    assert rel(got, want) < 1e-5  # the bias in two parts: twice the dtype's bits of it
    assert (logits[..., 100:110] < -1e3).all()  # empty slots drop out


def test_join_of_two_key_sets_is_attention_over_both():
    q, k, v, bias = inputs()
    want, _ = softmax_attention(q, k, v, bias)
    a, la = softmax_attention(q, k[:, :60], v[:, :60], bias[..., :60])
    b, lb = softmax_attention(q, k[:, 60:], v[:, 60:], bias[..., 60:])
    assert rel(flash4.join(a, la, b, lb), want) < 1e-6  # joined in fp32


def test_off_hopper_fa4_is_not_used():
    q, k, v, _ = inputs(lk=flash4.MIN_KEYS)
    assert not flash4.available(q) and not isinstance(backends.choose(q.device, q.dtype, 64), backends.FlashAttention4)


def _q_fold_rollouts(device, dtype, ann=None, frames=12, height=64, width=96, model="tiny"):
    """Two TempCache rollouts of one model, one computing each self-attention call's q into the cache's query
    fold (the backend's ``q_rows``), the other with q made apart: (videos, whether each call of the first found
    its q in the fold, the first's cache, its AnnSA's sparse calls)."""
    from comfyui_fastar.fastar import Rollout, TempCacheConfig
    from comfyui_fastar.fastar.models import build_model
    model = build_model(model, device=device, dtype=dtype, seed=2)
    ctx = torch.randn(1, 8, model.context_dim, device=device, generator=torch.Generator(device).manual_seed(1)).to(dtype)
    settings = dict(frames=frames, height=height, width=width, chunk_frames=3, seed=1, ann=ann,
                    cache=TempCacheConfig(max_cache_frames=9, sink_frames=3, merge_threshold=0.3))
    folded, apart = Rollout(model, ctx, **settings), Rollout(model, ctx, **settings)
    apart.attention.q_rows = lambda layer: None
    found, backend = [], folded.cache.backend
    for name in ("biased", "sparse"):  # each self-attention call over the cache: was q in the fold?
        call = getattr(backend, name)
        setattr(backend, name, lambda q, *a, call=call, **k: found.append(backend.folded_queries(q) is not None)
                or call(q, *a, **k))
    sparse = []
    if ann is not None:
        annsa = folded.attention.annsa
        attend = annsa.attention
        annsa.attention = lambda *a, **k: sparse.append(1) or attend(*a, **k)
    return (folded.run(), apart.run()), found, folded.cache, len(sparse)


def test_queries_computed_into_the_cache_fold_are_read_there(monkeypatch):
    """Where TempCache keeps its keys folded, the model computes each self-attention call's q into the
    cache's query fold (no fold per call): every call finds q there, the fold's own channels stay
    1 1 | 0 ..., and the video is the one q made apart gives, AnnSA's sparse calls among them. (The fold forced
    on the CPU: the calls then read q through its strides on the torch paths.)"""
    from comfyui_fastar.fastar import AnnConfig
    fold_forced(monkeypatch)
    (got, want), found, cache, sparse = _q_fold_rollouts("cpu", torch.float32, ann=AnnConfig(keep_fraction=0.5))
    assert cache.backend.key_pad == flash4.KEY_PAD and found and all(found) and sparse
    qf, d = cache.backend.folded_queries(cache.backend.q_rows(3 * cache.tokens_per_frame)), cache.head_dim
    assert (qf[..., d:d + 2] == 1).all() and (qf[..., d + 2:] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


cuda_fa4 = pytest.mark.skipif(not (torch.cuda.is_available() and flash4.available(
    torch.empty(1, device="cuda", dtype=torch.bfloat16) if torch.cuda.is_available() else torch.empty(1))),
    reason="FlashAttention-4 is not installed on a Hopper GPU (pip install comfyui-fastar[hopper])")


@pytest.mark.cuda
@cuda_fa4
@pytest.mark.parametrize("frames", [3, 12])
def test_fa4_calls_at_wan_shapes_against_fp32(frames):
    """Dense, biased (TempCache's layout: sink + chunk unbiased, then the history) and block-sparse
    FA4 calls within 1.5x cuDNN's error against fp64 math on sampled queries."""
    tpf, lq, h, d = 1560, 4680, 12, 128
    fixed, lk = 6 * tpf, (6 + frames) * tpf
    g = torch.Generator(device="cuda").manual_seed(frames)
    q = torch.randn(1, lq, h, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, lk, h, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    bias = torch.randint(1, 5, (1, h, lk), device="cuda", generator=g).float().log()
    bias[..., :fixed] = 0.0
    rows = slice(0, 512)
    ref0, _ = softmax_attention(q[:, rows], k, v)
    ref, ref_lse = softmax_attention(q[:, rows], k, v, bias)
    cudnn = rel(sdpa.attend_sdpa(q, k, v)[:, rows], ref0)
    assert rel(flash4.attention(q, k, v)[0][:, rows], ref0) <= 1.5 * cudnn
    out, lse = flash4.attention(q, k, v, key_bias=bias, bias_window=(fixed, lk))
    assert rel(out[:, rows], ref) <= 1.5 * cudnn
    assert (lse[:, :, rows].double() - ref_lse).abs().max() < 1e-2
    assert torch.equal(backends.FlashAttention4().biased(q, k, v, bias, (fixed, lk)), out)
    # block sparsity over the history: every query block reads the first half of its key blocks
    nkb = -(-(lk - fixed) // 128)
    nqb = -(-lq // 128)
    counts = torch.full((1, h, nqb), nkb // 2, dtype=torch.int32, device="cuda")
    idx = torch.arange(nkb, dtype=torch.int32, device="cuda").expand(1, h, nqb, nkb).contiguous()
    hist = slice(fixed, fixed + (nkb // 2) * 128)
    sparse, _ = flash4.attention(q, k[:, fixed:], v[:, fixed:], key_bias=bias[..., fixed:].contiguous(),
                                 blocks=(counts, idx))
    want, _ = softmax_attention(q[:, rows], k[:, hist], v[:, hist], bias[..., hist])
    assert rel(sparse[:, rows], want) <= 1.5 * cudnn


@pytest.mark.parametrize("merge", [1, 2])
def test_range_blocks_lists_the_blocks_a_plan_covers(merge):
    """AnnSA's plan (runs of picked key blocks, the last one partial) as FA4's block lists: the same
    blocks, ascending, per query block or per ``merge`` of them (their union)."""
    g = torch.Generator().manual_seed(merge)
    nqb, nkb, kb, start = 7, 11, 8, 13
    n_keys = nkb * kb - 3
    sel = torch.rand(1, 2, nqb, nkb, generator=g) < 0.4
    starts = start + torch.arange(nkb) * kb
    ends = (starts + kb).clamp(max=start + n_keys)
    ranges, counts = runs_to_ranges(sel, starts.expand_as(sel), ends.expand_as(sel), 2 + nkb, sink=5,
                                    chunk_start=100, chunk_stop=120)
    got_counts, got_idx = range_blocks(ranges[..., 2:, :], counts - 2, start, n_keys, kb, merge)
    want = torch.nn.functional.pad(sel, (0, 0, 0, -nqb % merge)).view(1, 2, -1, merge, nkb).any(-2)
    assert got_counts.dtype == got_idx.dtype == torch.int32
    assert torch.equal(got_counts, want.sum(-1, dtype=torch.int32))
    for b, h, i in zip(*[t.flatten().tolist() for t in torch.meshgrid(*map(torch.arange, want.shape[:3]),
                                                                    indexing="ij")]):
        listed = got_idx[b, h, i, :got_counts[b, h, i]].tolist()
        assert listed == want[b, h, i].nonzero().flatten().tolist()  # ascending: the partial block last


@pytest.mark.cuda
@cuda_fa4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_cache_keeps_the_fold_of_its_bias_on_the_gpu(dtype):
    """After a TempCache + AnnSA rollout at FA4's shapes (2 heads of 128, 1560 tokens a frame; merges on
    the side stream, AnnSA's permutations), every layer's folded keys are the per-call fold of its keys
    and bias, and the biased call on them equals the call that folds; in fp16 (ComfyUI's default weight
    dtype) as in bf16, the video is finite (the first chunks see empty slots)."""
    from comfyui_fastar.fastar import AnnConfig, Rollout, TempCacheConfig
    from comfyui_fastar.fastar.models import WanConfig, build_model
    model = build_model(WanConfig(dim=256, ffn_dim=256, num_heads=2, num_layers=2, text_dim=64, freq_dim=64),
                        device="cuda", dtype=dtype, seed=2)
    ctx = torch.randn(1, 8, 64, device="cuda", dtype=dtype)
    run = Rollout(model, ctx, frames=15, height=480, width=832, chunk_frames=3, seed=1, ann=AnnConfig(),
                  cache=TempCacheConfig(max_cache_frames=9, sink_frames=3, merge_threshold=0.3))
    cache, backend = run.cache, run.cache.backend
    assert backend.key_pad == flash4.KEY_PAD
    assert run.run().isfinite().all()
    cache.begin_chunk(cache.frames_cached, 3)
    q = torch.randn(1, 3 * 1560, 2, 128, device="cuda", dtype=dtype)
    for layer in range(2):
        keys, values, bias = cache.k[layer, :, :cache.layout.attended], cache.v[layer, :, :cache.layout.attended], \
            cache.log_count_bias[layer, ..., :cache.layout.attended]
        want = flash4.fold_bias_into_keys(q, keys, bias, cache.layout.bias)[1]
        assert torch.equal(backend.folded_keys(keys), want)
        # the call on the arena's keys equals the call on a copy of them, which it folds itself
        assert torch.equal(backend.biased(q, keys, values, bias, cache.layout.bias),
                           backend.biased(q, keys.clone(), values, bias, cache.layout.bias))


@pytest.mark.cuda
@cuda_fa4
def test_queries_computed_into_the_cache_fold_on_fa4():
    """On FA4 (TempCache + AnnSA at 1560 tokens a frame, bf16): every self-attention call reads q from the
    cache's query fold, and the video is the one q made apart (and folded per call) gives."""
    from comfyui_fastar.fastar import AnnConfig
    from comfyui_fastar.fastar.models import WanConfig
    config = WanConfig(dim=256, ffn_dim=256, num_heads=2, num_layers=2, text_dim=64, freq_dim=64)
    (got, want), found, _, sparse = _q_fold_rollouts("cuda", torch.bfloat16, ann=AnnConfig(), frames=15, height=480,
                                                     width=832, model=config)
    assert found and all(found) and sparse  # AnnSA's blocks on FA4 among the calls
    assert got.isfinite().all() and rel(got, want) < 1e-2  # merges add atomically: not bit-identical
