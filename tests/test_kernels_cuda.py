"""On a GPU, what spans more than one kernel file: the FFN's GELU epilogue equals GEMM + tanh GELU,
the first step's biased dense attention (the block-sparse kernel, cuDNN as its prior) equals cuDNN
with the bias as a mask, cuDNN's log-sum-exp is fp32 math's, TempCache's fp8 match finds the best
cosine, and its history writes through the row kernels equal the twins'. Each kernel's own checks
against its twin, at the chunk's shape here too, are in its test file.
"""
import pytest
import torch

from comfyui_fastar.fastar.models.wan import WanAttentionBlock, WanConfig
from comfyui_fastar.fastar.backend import Triton
from comfyui_fastar.fastar.sdpa import attend_lse, attend_sdpa
from comfyui_fastar.fastar.tempcache import _fp8_gemm, _top1_fp8

pytestmark = pytest.mark.cuda


def test_gelu_epilogue_equals_gemm_then_gelu():
    cfg = WanConfig(dim=256, ffn_dim=1024, num_heads=2, num_layers=1)
    block = WanAttentionBlock(cfg).cuda().bfloat16()
    h = torch.randn(1, 3, 50, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).bfloat16()
    up, act, down = block.ffn
    with torch.no_grad():
        got, want = block.feed_forward(h).float(), down(act(up(h))).float()
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16 roundings of the hidden layer apart


@pytest.mark.parametrize("heads", [12, 40], ids=["wan1.3B", "wan14B"])
@pytest.mark.parametrize("lo, hi", [(1560, 4680), (3120, 6240)], ids=["window-inside", "history-last"])
def test_attend_biased_equals_cudnn_with_the_mask(lo, hi, heads):
    """The first step's biased dense attention on the kernel equals cuDNN SDPA with the bias as a mask:
    the kernel on all keys, or (window reaching the last key) cuDNN on the keys before it as a prior."""
    g = torch.Generator(device="cuda").manual_seed(6)
    Lq, Lk = 1560, 6240
    q = torch.randn(1, Lq, heads, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, Lk, heads, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    bias = torch.zeros(1, heads, Lk, device="cuda")
    bias[..., lo:hi] = torch.log(torch.randint(1, 4, (1, heads, hi - lo), device="cuda", generator=g).float())
    bias[..., lo:lo + 100] = float("-inf")  # empty slots
    got = Triton().biased(q, k, v, bias, (lo, hi)).float()
    want = attend_sdpa(q, k, v, key_bias=bias).float()
    assert got.shape == want.shape == (1, Lq, heads, 128)
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


def test_tempcache_writes_through_the_row_kernels_equal_the_twins():
    """A layer's TempCache merges at real head shapes, several chunks: history rows written through
    the row, merge, cosine and argmax kernels equal the torch twins' (keys exactly; values up to
    the rounding of the bf16 atomic adds of tokens merging into one slot), as do the slot states."""
    from comfyui_fastar.fastar import TempCacheConfig, make_cache
    from comfyui_fastar.fastar import tempcache as tc
    from comfyui_fastar.kernels.merge_rows import merge_rows_torch
    from comfyui_fastar.kernels.pair_cosine import pair_cosine_torch
    from comfyui_fastar.kernels.row_argmax import row_argmax_torch
    from comfyui_fastar.kernels.rows import gather_rows_torch, scatter_rows_torch

    tpf, h, d = 320, 12, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(1, tpf, h, d, device="cuda", generator=g)
    chunks = [((base + s * torch.randn(1, tpf, h, d, device="cuda", generator=g)).bfloat16(),
               torch.randn(1, tpf, h, d, device="cuda", generator=g).bfloat16()) for s in (0, 0.05, 0.1, 2.0, 2.0, 2.0, 0.05, 0.3)]
    caches, taken = {}, [0, 0]  # merges and evictions over the kernel path's writes
    for name in ("kernel", "twin"):
        kv = make_cache(TempCacheConfig(merge_threshold=0.95, max_cache_frames=4, sink_frames=1), num_layers=1,
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
                kv.attend(0, k, v)
                kv.write_history(0, k)
                kv.commit()
                if name == "kernel":
                    taken[0] += kv._merged.sum().item()
                    taken[1] += kv._evicted.sum().item()
        finally:
            for f, fn in zip(names, saved):
                setattr(tc, f, fn)
        caches[name] = kv
    a, b = caches["kernel"], caches["twin"]
    assert taken[0] > 0 and taken[1] > 0  # both paths taken
    held = a.dump  # every row but the dump row, which of its writes it keeps is unspecified
    assert torch.equal(a.k[:, :, :held], b.k[:, :, :held])
    torch.testing.assert_close(a.v[:, :, :held], b.v[:, :, :held], rtol=1e-2, atol=1e-2)
    for name in ("_count", "_newest", "_token"):  # the merge state, private to the cache
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert torch.equal(a.log_count_bias, b.log_count_bias)
