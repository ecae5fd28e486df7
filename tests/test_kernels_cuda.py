"""On a GPU: the compiled kernels equal their twins (adaLN and q/k norm + RoPE at the Wan 1.3B chunk
shape and at odd ones; the block-sparse attention with a bias window), the FFN's GELU epilogue
equals GEMM + tanh GELU, TempCache's fp8 match finds the best cosine, and its history writes through
the row kernels equal the twins'. CUDA-only: skipped without a GPU.
"""
import pytest
import torch

from comfyui_fastar.fastar.sdpa import attend, attend_biased, attend_lse
from comfyui_fastar.fastar.tempcache import _fp8_gemm, _top1_fp8
from comfyui_fastar.fastar.models.wan import WanAttentionBlock, WanConfig, rope_frequencies
from comfyui_fastar.kernels.adaln import adaln, adaln_torch
from comfyui_fastar.kernels.block_means import block_means, block_means_torch
from comfyui_fastar.kernels.gather_rows import gather_rows, gather_rows_torch
from comfyui_fastar.kernels import block_sparse_attention as bsa
from comfyui_fastar.kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_torch
from comfyui_fastar.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_torch

pytestmark = pytest.mark.cuda

SHAPES = [(1, 3, 1560, 1536, 3), (2, 2, 37, 96, 1), (1, 1, 5, 40, 1)]  # B, F, S, C, T


@pytest.mark.parametrize("shape", SHAPES, ids=["wan1.3B", "odd", "tiny"])
def test_adaln_kernel_equals_twin(shape):
    b, f, s, c, t = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(b, f, s, c, device="cuda", generator=g).bfloat16() for _ in range(2))
    gate, scale, shift = (0.3 * torch.randn(b, t, c, device="cuda", generator=g) for _ in range(3))
    gate, scale, shift = gate.bfloat16(), scale.bfloat16(), shift.bfloat16()
    for kw in ({}, {"y": y}, {"y": y, "gate": gate}):
        for one_plus in (True, False):
            got = adaln(x, scale, shift, one_plus=one_plus, **kw)
            want = adaln_torch(x, scale, shift, one_plus=one_plus, **kw)
            for gt, wt in zip(got, want):
                torch.testing.assert_close(gt.float(), wt.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(1, 4680, 12, 128), (2, 37, 3, 24), (1, 5, 1, 2)], ids=["wan1.3B", "odd", "tiny"])
def test_qk_norm_rope_kernel_equals_twin(shape):
    b, length, heads, d = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(b, length, heads * d, device="cuda", generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(heads * d, device="cuda", generator=g)).bfloat16()
    freqs = rope_frequencies(d, (length, 1, 1), 7, device="cuda")
    for weight in (w, None):
        torch.testing.assert_close(qk_norm_rope(x, weight, freqs, heads).float(),
                                   qk_norm_rope_torch(x, weight, freqs, heads).float(), rtol=1e-2, atol=1e-2)


def test_gelu_epilogue_equals_gemm_then_gelu():
    cfg = WanConfig(dim=256, ffn_dim=1024, num_heads=2, num_layers=1)
    block = WanAttentionBlock(cfg).cuda().bfloat16()
    h = torch.randn(1, 3, 50, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).bfloat16()
    up, act, down = block.ffn
    with torch.no_grad():
        got, want = block.feed_forward(h).float(), down(act(up(h))).float()
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16 roundings of the hidden layer apart


def test_block_sparse_bias_window_equals_twin():
    """A TempCache-like layout: sink [0, 40), history [40, 260) with log m / -inf biases, the open
    chunk [260, 300); the sink's and chunk's ranges skip the bias, the history's read it."""
    g = torch.Generator(device="cuda").manual_seed(3)
    B, H, Lq, Lk, D, bq = 1, 2, 100, 300, 128, 32
    q, k, v = (torch.randn(B, H, n, D, device="cuda", generator=g).bfloat16() for n in (Lq, Lk, Lk))
    bias = torch.zeros(B, H, Lk, device="cuda")
    bias[..., 40:260] = torch.log(torch.randint(1, 5, (B, H, 220), device="cuda", generator=g).float())
    bias[..., 100:130] = float("-inf")  # empty history slots
    nqb = (Lq + bq - 1) // bq
    ranges = torch.zeros(B, H, nqb, 5, 2, dtype=torch.int32, device="cuda")
    ranges[..., 0, :] = torch.tensor([0, 40])
    ranges[..., 1, :] = torch.tensor([260, 300])
    ranges[..., 2, :] = torch.tensor([40, 77])
    ranges[..., 3, :] = torch.tensor([95, 190])  # straddles the empty slots
    ranges[..., 4, :] = torch.tensor([200, 260])
    counts = torch.full((B, H, nqb), 5, dtype=torch.int32, device="cuda")
    counts[0, 1, 1] = 2  # one block reads only the sink and the chunk
    kw = dict(key_bias=bias, block_q=bq, bias_window=(40, 260))
    got = block_sparse_attention(q, k, v, ranges, counts, **kw).float()
    want = block_sparse_attention_torch(q.float(), k.float(), v.float(), ranges, counts, **kw)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    whole = block_sparse_attention(q, k, v, ranges, counts, key_bias=bias, block_q=bq).float()
    assert ((got - whole).norm() / whole.norm()).item() < 1e-2  # the bias is 0 outside the window anyway


@pytest.mark.parametrize("splits", [None, 2, 3], ids=["last-wave", "2", "3"])
def test_block_sparse_key_splits_equal_unsplit_at_the_chunk_shape(splits):
    """At the Wan 1.3B chunk shape (4680 queries, 12 heads, sink + biased history + chunk), a split
    kernel's output (the default splits the last wave's blocks) equals the unsplit one's to bf16
    rounding, with and without a permutation."""
    g = torch.Generator(device="cuda").manual_seed(4)
    H, Lq, Lk, lo, hi = 12, 4680, 9360, 1560, 4680
    q, k, v = (torch.randn(1, H, n, 128, device="cuda", generator=g).bfloat16() for n in (Lq, Lk, Lk))
    bias = torch.zeros(1, H, Lk, device="cuda")
    bias[..., lo:hi] = torch.log(torch.randint(1, 4, (1, H, hi - lo), device="cuda", generator=g).float())
    nqb = -(-Lq // 64)
    ranges = torch.zeros(1, H, nqb, 9, 2, dtype=torch.int32, device="cuda")
    ranges[..., 0, 1], ranges[..., 1, 0], ranges[..., 1, 1] = lo, hi, Lk
    starts = lo + 128 * torch.rand(1, H, nqb, 24, device="cuda", generator=g).argsort(-1)[..., :7].sort(-1).values
    ranges[..., 2:, 0], ranges[..., 2:, 1] = starts.int(), (starts + 100).int()
    counts = torch.randint(0, 10, (1, H, nqb), dtype=torch.int32, device="cuda", generator=g)
    perm = torch.stack([torch.randperm(Lq, device="cuda", generator=g) for _ in range(H)])[None]
    for kw in ({}, {"q_perm": perm}):
        kw.update(key_bias=bias, bias_window=(lo, hi))
        one = block_sparse_attention(q, k, v, ranges, counts, num_splits=1, **kw).float()
        split = block_sparse_attention(q, k, v, ranges, counts, num_splits=splits, **kw).float()
        assert ((split - one).norm() / one.norm()).item() < 4e-3
    if splits is None:  # the wave was read from the compiled kernel: a whole number of programs per SM
        waves = [w for key, w in bsa._WAVES.items() if key[0] == q.device]
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        assert waves and all(w > 0 and w % sms == 0 for w in waves)


def test_block_means_equal_twin_at_the_budget():
    """AnnSA's block means of a Wan 1.3B layer's history at the TempCache budget (28080 keys of a
    [B, L, H, D] cache buffer, a tenth of the slots empty): the kernel equals the twin."""
    g = torch.Generator(device="cuda").manual_seed(7)
    buf = torch.randn(1, 37440, 12, 128, device="cuda", generator=g).bfloat16()
    k = buf[:, 4680:32760]
    filled = torch.rand(1, 12, 28080, device="cuda", generator=g) > 0.1
    mean, count = block_means(k, filled, 128)
    want_mean, want_count = block_means_torch(k, filled, 128)
    assert torch.equal(count, want_count)
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-5)


def test_gather_rows_equals_torch_gather_at_the_budget():
    """AnnSA's re-sort of a Wan 1.3B layer's history (28080 rows x 12 heads of a cache buffer)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    buf = torch.randn(1, 37440, 12, 128, device="cuda", generator=g).bfloat16()
    part = buf[:, 4680:32760]
    perm = torch.stack([torch.randperm(28080, device="cuda", generator=g) for _ in range(12)])[None]
    assert torch.equal(gather_rows(part, perm), gather_rows_torch(part, perm))


@pytest.mark.parametrize("lo, hi", [(1560, 4680), (3120, 6240)], ids=["window-inside", "history-last"])
def test_attend_biased_equals_cudnn_with_the_mask(lo, hi):
    """The first step's biased dense attention on the kernel equals cuDNN SDPA with the bias as a mask:
    the kernel on all keys, or (window reaching the last key) cuDNN on the keys before it as a prior."""
    g = torch.Generator(device="cuda").manual_seed(6)
    Lq, Lk = 1560, 6240
    q = torch.randn(1, Lq, 12, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, Lk, 12, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    bias = torch.zeros(1, 12, Lk, device="cuda")
    bias[..., lo:hi] = torch.log(torch.randint(1, 4, (1, 12, hi - lo), device="cuda", generator=g).float())
    bias[..., lo:lo + 100] = float("-inf")  # empty slots
    got = attend_biased(q, k, v, bias, (lo, hi)).float()
    want = attend(q, k, v, key_bias=bias).float()
    assert got.shape == want.shape == (1, Lq, 12, 128)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_attend_lse_is_cudnn_with_its_log_sum_exp():
    """The prior cuDNN gives the kernel: its output and natural log-sum-exp, as fp32 math has them."""
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(1, 4680, 12, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 9360, 12, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    out, lse = attend_lse(q, k, v)
    logits = q.float().transpose(1, 2) @ k.float().permute(0, 2, 3, 1) / 128 ** 0.5
    assert out.shape == (1, 12, 4680, 128) and lse.shape == (1, 12, 4680) and lse.dtype == torch.float32
    assert (lse - logits.logsumexp(-1)).abs().max().item() < 2e-2
    want = logits.softmax(-1) @ v.float().transpose(1, 2)
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or not _fp8_gemm(torch.device("cuda")), reason="no fp8 tensor cores")
def test_tempcache_fp8_match_finds_the_best_cosine():
    """Planted near-copies are found; every pick is within fp8's rounding of the best cosine, never
    an empty slot when a filled one scores above 0."""
    g = torch.Generator(device="cuda").manual_seed(5)
    M, N, C = 3000, 601, 1536
    keys = (torch.randn(M, C, device="cuda", generator=g) * torch.rand(M, 1, device="cuda", generator=g) * 4).bfloat16()
    filled = torch.rand(M, device="cuda", generator=g) > 0.1
    src = torch.nonzero(filled).flatten()[torch.randperm(int(filled.sum()), device="cuda", generator=g)[:N]]
    rms = keys[src].float().pow(2).mean(-1, keepdim=True).sqrt()
    x = (keys[src].float() + 0.4 * rms * torch.randn(N, C, device="cuda", generator=g)).bfloat16()  # cosine ~0.93
    cos = torch.nn.functional.normalize(x.float(), dim=-1) @ torch.nn.functional.normalize(keys.float(), dim=-1).T
    cos = cos.masked_fill(~filled, float("-inf"))
    # each head's slots in its own order (as AnnSA sorts them), lined up again through canon
    canon = torch.stack([torch.randperm(M, device="cuda", generator=g) for _ in range(12)])
    stored = torch.empty(M, 12, 128, device="cuda", dtype=keys.dtype)
    for i in range(12):
        stored[canon[i], i] = keys.view(M, 12, 128)[:, i]
    for idx in (_top1_fp8(x.view(N, 12, 128), keys.view(M, 12, 128), None, filled),
                _top1_fp8(x.view(N, 12, 128), stored, canon, filled)):
        assert idx.shape == (N,) and bool(filled[idx].all())
        assert (idx == src).float().mean().item() > 0.99
        assert (cos.max(-1).values - cos.gather(1, idx[:, None]).squeeze(1)).max().item() < 2e-3


def test_unit_fp8_kernel_equals_its_twin():
    """The history's side at the Wan 1.3B budget (28080 tokens, heads lined up through a per-head
    order, empty slots) and odd sizes: the same fp8 values up to one rounding step where the fp32
    norms differ in their last bit."""
    from comfyui_fastar.kernels.unit_fp8 import unit_fp8, unit_fp8_torch

    g = torch.Generator(device="cuda").manual_seed(6)
    for m, h, d, aligned in ((28080, 12, 128, True), (4680, 12, 128, False), (37, 3, 16, True)):
        src = (torch.randn(m + 3, h, d, device="cuda", generator=g) * 3)[2:m + 2].bfloat16()
        index = torch.stack([torch.randperm(m, device="cuda", generator=g) for _ in range(h)]) if aligned else None
        held = torch.rand(m, device="cuda", generator=g) > 0.1 if aligned else None
        m_out = -(-m // 16) * 16
        got, want = unit_fp8(src, index, held, m_out).float(), unit_fp8_torch(src, index, held, m_out).float()
        assert got.shape == want.shape == (m_out, h * d)
        assert (got - want).abs().le(2.0 ** -3 * want.abs()).all()
        assert (got != want).float().mean().item() < 1e-3
        assert got[m:].eq(0).all()


def test_tempcache_writes_through_the_row_kernels_equal_the_twins():
    """A layer's TempCache merges at real head shapes, several chunks: history rows written through
    the row, merge, cosine and argmax kernels equal the torch twins' (keys exactly; values up to
    the rounding of the bf16 atomic adds of tokens merging into one slot), as do the slot states."""
    from comfyui_fastar.fastar import KVCache, TempCacheConfig
    from comfyui_fastar.fastar import tempcache as tc
    from comfyui_fastar.kernels.gather_rows import gather_rows_torch
    from comfyui_fastar.kernels.merge_rows import merge_rows_torch
    from comfyui_fastar.kernels.pair_cosine import pair_cosine_torch
    from comfyui_fastar.kernels.row_argmax import row_argmax_torch
    from comfyui_fastar.kernels.scatter_rows import scatter_rows_torch

    tpf, h, d = 320, 12, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(1, tpf, h, d, device="cuda", generator=g)
    chunks = [((base + s * torch.randn(1, tpf, h, d, device="cuda", generator=g)).bfloat16(),
               torch.randn(1, tpf, h, d, device="cuda", generator=g).bfloat16()) for s in (0, 0.05, 0.1, 2.0, 2.0, 2.0, 0.05, 0.3)]
    caches, taken = {}, [0, 0]  # merges and evictions over the kernel path's writes
    for name in ("kernel", "twin"):
        kv = KVCache(TempCacheConfig(merge_threshold=0.95, max_cache_frames=4, sink_frames=1), num_layers=1,
                     batch=1, num_heads=h, head_dim=d, tokens_per_frame=tpf, chunk_frames=1, device="cuda",
                     dtype=torch.bfloat16)
        names = ("scatter_rows_auto", "gather_rows_auto", "merge_rows_auto", "pair_cosine_auto", "row_argmax_auto")
        saved = [getattr(tc, f) for f in names]
        if name == "twin":
            for f, twin in zip(names, (scatter_rows_torch, gather_rows_torch, merge_rows_torch, pair_cosine_torch,
                                       row_argmax_torch)):
                setattr(tc, f, twin)
        try:
            for k, v in chunks:
                kv.begin_chunk(kv.frames_cached, 1)
                kv.begin_clean_pass()
                kv.extend(0, k, v)
                kv.after_attention(0, k)
                kv.commit()
                if name == "kernel":
                    taken[0] += kv.tempcache.merged.sum().item()
                    taken[1] += kv.tempcache.evicted.sum().item()
        finally:
            for f, fn in zip(names, saved):
                setattr(tc, f, fn)
        caches[name] = kv
    a, b = caches["kernel"], caches["twin"]
    assert taken[0] > 0 and taken[1] > 0  # both paths taken
    held = 4 * tpf
    assert torch.equal(a.k[:, :, :held], b.k[:, :, :held])
    torch.testing.assert_close(a.v[:, :, :held], b.v[:, :, :held], rtol=1e-2, atol=1e-2)
    for name in ("count", "newest", "token"):
        assert torch.equal(getattr(a.tempcache, name), getattr(b.tempcache, name))
    assert torch.equal(a.log_count_bias, b.log_count_bias)


def test_pair_cosine_kernel_equals_its_twin():
    """A chunk of Wan 1.3B's tokens against a history at its budget, each head its own slot order."""
    from comfyui_fastar.kernels.pair_cosine import pair_cosine, pair_cosine_torch

    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(4680, 12, 128, device="cuda", generator=g).bfloat16()
    src = (torch.randn(28081, 12, 128, device="cuda", generator=g) * 2).bfloat16()[1:]
    rows = torch.randint(0, 28080, (12, 4680), device="cuda", generator=g)
    rows[:, :100] = torch.arange(100, device="cuda")
    x[:100] = src[:100]  # pairs of a token with itself
    got, want = pair_cosine(x, src, rows), pair_cosine_torch(x, src, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:100], torch.ones(100, device="cuda"), rtol=1e-5, atol=1e-6)


def test_merge_rows_kernel_equals_its_twin():
    """bf16 at Wan 1.3B's shapes, groups of up to ~4 tokens per slot: the representative's row in
    fp32 then the others' shares added in bf16 stay within bf16 rounding of the fp32 twin."""
    from comfyui_fastar.kernels.merge_rows import merge_rows, merge_rows_torch

    g = torch.Generator(device="cuda").manual_seed(9)
    m, n, h, d = 28080, 4680, 12, 128
    k, v = (torch.randn(m, h, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    new_k, new_v = (torch.randn(n, h, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    slot = torch.randint(0, 2000, (h, n), device="cuda", generator=g)
    count = torch.randint(0, 5, (h, m), device="cuda", generator=g).float()
    merge = (torch.rand(h, n, device="cuda", generator=g) < 0.6) & (count.gather(1, slot) > 0)
    added = torch.zeros(h, m, device="cuda").scatter_add_(1, slot, merge.float())
    token = torch.arange(n, device="cuda")
    rep = torch.full((h, m), -1, device="cuda").scatter_reduce_(1, slot, torch.where(merge, token, -1), "amax")
    assert added.max().item() >= 3
    k2, v2 = k.clone(), v.clone()
    merge_rows(k, v, new_k, new_v, slot, merge, count, added, rep)
    merge_rows_torch(k2, v2, new_k, new_v, slot, merge, count, added, rep)
    assert torch.equal(k, k2)
    torch.testing.assert_close(v, v2, rtol=2e-2, atol=2e-2)
    assert ((v.float() - v2.float()).norm() / v2.float().norm()).item() < 3e-3


def test_row_argmax_kernel_equals_its_twin():
    """A block of the fp8 match's bf16 scores (many exact ties at bf16's resolution)."""
    from comfyui_fastar.kernels.row_argmax import row_argmax, row_argmax_torch

    g = torch.Generator(device="cuda").manual_seed(10)
    s = (torch.randn(1024, 28080, device="cuda", generator=g) * 4096).bfloat16()
    s[::7, 5] = 1e6
    assert torch.equal(row_argmax(s), row_argmax_torch(s))
    assert torch.equal(row_argmax(s[:, 1:]), row_argmax_torch(s[:, 1:]))
