"""AnnSA 'quant' planning scores and top-p shares (kernels/quant_block_scores.py,
kernels/quant_block_shares.py): twins vs brute force, Triton kernels vs twins."""

import pytest
import torch

from comfyui_fastar.kernels.quant_block_scores import quant_block_scores, quant_block_scores_torch, quantize_blocks
from comfyui_fastar.kernels.quant_block_shares import quant_block_shares, quant_block_shares_torch


def _case(gen, b, h, lq, d, nkb, dtype=torch.float32, device="cpu"):
    q = torch.randn(b, lq, h, d, generator=gen).to(device, dtype).transpose(1, 2)  # the [B, n, H, D] cache view
    means = torch.randint(-127, 128, (b, h, nkb, d), generator=gen, dtype=torch.int8)
    logit_scale = torch.rand(b, h, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(b, h, nkb, generator=gen).masked_fill(torch.rand(b, h, nkb, generator=gen) < 0.2, float("-inf"))
    return q, means.to(device), logit_scale.to(device), bias.to(device)


def _brute(q, means, logit_scale, bias, block_q):
    b, h, lq, _ = q.shape
    nqb, nkb = -(-lq // block_q), means.shape[2]
    out = torch.full((b, h, nqb, nkb), float("-inf"))
    for bi in range(b):
        for hi in range(h):
            for i in range(nqb):
                block = q[bi, hi, i * block_q:(i + 1) * block_q].float()
                inv = torch.tensor(127.0) / block.abs().max()
                levels = [[max(-127, min(127, int(torch.floor(x * inv + 0.5)))) for x in row] for row in block]
                for j in range(nkb):
                    dot = max(sum(a * int(c) for a, c in zip(row, means[bi, hi, j])) for row in levels)
                    out[bi, hi, i, j] = dot * (logit_scale[bi, hi] / inv) + bias[bi, hi, j]
    return out


def test_twin_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    case = _case(gen, 1, 2, 11, 8, 5)
    torch.testing.assert_close(quant_block_scores_torch(*case, 4), _brute(*case, 4), rtol=0, atol=0)


def test_each_query_block_spans_the_int8_range():
    """Every block gets its own scale: a block of small queries is resolved as finely as a large one."""
    gen = torch.Generator().manual_seed(1)
    q = _case(gen, 1, 3, 20, 16, 1)[0] * torch.tensor([1e-3] * 8 + [1.0] * 8 + [50.0] * 4)[:, None]
    levels, inv = quantize_blocks(q, 8)
    per_block = levels.view(1, 3, 3, 8 * 16).abs().amax(-1)
    assert per_block.eq(127).all() and levels.eq(levels.round()).all()
    assert (inv[..., 0] > 100 * inv[..., 1]).all()


def test_twin_takes_the_cache_view_of_whole_blocks():
    """Queries filling whole blocks come unpadded, as the strided [B, n, H, D] cache view: the
    twin (the CPU path without Triton) scores them as it scores a contiguous copy."""
    gen = torch.Generator().manual_seed(4)
    q, means, logit_scale, bias = _case(gen, 1, 2, 12, 8, 5)
    assert not q.is_contiguous()
    torch.testing.assert_close(quant_block_scores_torch(q, means, logit_scale, bias, 4),
                               quant_block_scores_torch(q.contiguous(), means, logit_scale, bias, 4), rtol=0, atol=0)
    fixed = _fixed_case(gen, 1, 2, 8, 3)
    for got, want in zip(quant_block_shares_torch(q, means, logit_scale, bias, *fixed, 4),
                         quant_block_shares_torch(q.contiguous(), means, logit_scale, bias, *fixed, 4)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(dtype, device):
    gen = torch.Generator().manual_seed(2)
    for b, h, lq, d, nkb, block_q in [(1, 1, 1, 16, 1, 64), (2, 3, 70, 16, 67, 64), (1, 2, 33, 32, 130, 16),
                                      (1, 1, 129, 64, 3, 128), (1, 2, 5, 16, 0, 4)]:
        case = _case(gen, b, h, lq, d, nkb, dtype, device)
        case[0][..., :block_q, :] = 0  # an all-zero query block: its scale is clamped, its scores the bias
        want = quant_block_scores_torch(*case, block_q)
        got = quant_block_scores(*case, block_q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _shares_brute(q, means, logit_scale, bias, fmeans, fcounts, block_q):
    """Per query in float64 from its int8 levels: shares of every block over the query's logsumexp
    across fixed and history blocks (float means read in fp16, log counts), averaged over the
    block's queries."""
    b, h, lq, _ = q.shape
    nqb, nkb = -(-lq // block_q), means.shape[2]
    levels, inv = quantize_blocks(q, block_q)
    out, out_f = torch.zeros(b, h, nqb, nkb, dtype=torch.float64), torch.zeros(b, h, nqb, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(nqb):
                rows = levels[bi, hi, i * block_q:min((i + 1) * block_q, lq)].double()
                hist = rows @ means[bi, hi].double().T * (logit_scale[bi, hi].double() / inv[bi, hi, i]) + bias[bi, hi]
                fixed = (rows @ fmeans[bi, hi].half().double().T / (inv[bi, hi, i] * rows.shape[-1] ** 0.5)
                         + fcounts[bi, hi].double().log())
                lse = torch.cat([hist, fixed], -1).logsumexp(-1, keepdim=True)
                out[bi, hi, i] = (hist - lse).exp().mean(0).log()
                out_f[bi, hi, i] = (fixed.logsumexp(-1) - lse[:, 0]).exp().mean().log()
    return out.float(), out_f.float()


def _fixed_case(gen, b, h, d, nf, device="cpu"):
    means = torch.randn(b, h, nf, d, generator=gen) * 0.05
    counts = torch.randint(1, 129, (b, h, nf), generator=gen).float()
    counts[..., 0] = 0  # an empty fixed block (an unwritten sink block)
    return means.to(device), counts.to(device)


def test_shares_twin_matches_brute_force():
    gen = torch.Generator().manual_seed(3)
    case = (*_case(gen, 1, 2, 11, 8, 5), *_fixed_case(gen, 1, 2, 8, 3))
    got, want = quant_block_shares_torch(*case, 4), _shares_brute(*case, 4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    # a query's shares sum to 1, so do their means over a block
    total = torch.cat([got[0], got[1][..., None]], -1).exp().sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total))


def test_shares_credit_each_cluster_of_a_mixed_block():
    """Two queries of one block, one sharply matching key block 0 (logit 40), one mildly matching
    block 1 (logit 4): each query's own mass sums to one, so block 1 holds about half of the
    block's mass, where a softmax over the block-max scores would give it exp(-36)."""
    d = 16
    q = torch.zeros(1, 1, 2, d)
    q[0, 0, 0, 0], q[0, 0, 1, 1] = 1.0, 0.1
    means = torch.zeros(1, 1, 3, d, dtype=torch.int8)
    means[0, 0, 0, 0], means[0, 0, 1, 1] = 127, 127
    scale = torch.tensor([[40.0 / 127]])  # query 1.0 x mean 127 -> logit 40
    fixed = (torch.zeros(1, 1, 1, d), torch.ones(1, 1, 1))
    share, fixed_share = quant_block_shares_torch(q, means, scale, torch.zeros(1, 1, 3), *fixed, 2)
    assert share[0, 0, 0, 1].exp() > 0.4 and share[0, 0, 0, 0].exp() > 0.45
    top = quant_block_scores_torch(q, means, scale, torch.zeros(1, 1, 3), 2)[0, 0, 0]
    assert top.softmax(-1)[1] < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shares_kernel_matches_twin(dtype, device):
    gen = torch.Generator().manual_seed(4)
    for b, h, lq, d, nkb, nf, block_q in [(1, 1, 1, 16, 1, 1, 64), (2, 3, 70, 16, 67, 5, 64),
                                          (1, 2, 33, 32, 130, 70, 16), (1, 1, 129, 64, 3, 2, 128)]:
        case = (*_case(gen, b, h, lq, d, nkb, dtype, device), *_fixed_case(gen, b, h, d, nf, device))
        case[0][..., :block_q, :] = 0
        want = quant_block_shares_torch(*case, block_q)
        got = quant_block_shares(*case, block_q)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 4, 16)), "q must"),
    (dict(key_means=torch.zeros(1, 2, 3, 16)), "key_means"),
    (dict(logit_scale=torch.ones(1, 2, dtype=torch.float64)), "logit_scale"),
    (dict(block_bias=torch.zeros(1, 2, 4)), "block_bias"),
])
def test_bad_inputs_name_the_problem(bad, match):
    args = dict(q=torch.zeros(1, 2, 4, 16), key_means=torch.zeros(1, 2, 3, 16, dtype=torch.int8),
                logit_scale=torch.ones(1, 2), block_bias=torch.zeros(1, 2, 3))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quant_block_scores_torch(*args.values(), block_q=4)
