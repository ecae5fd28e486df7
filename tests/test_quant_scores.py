"""AnnSA 'quant' planning scores: twin vs brute force, Triton kernel vs twin (CPU interpreter).

The flag must be set before anything imports triton.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from comfyui_fastar.kernels import HAS_TRITON  # noqa: E402
from comfyui_fastar.kernels.quant_scores import (  # noqa: E402
    quant_block_scores,
    quant_block_scores_torch,
    quantize_queries,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")


def _case(gen, b, h, lq, d, nkb, dtype=torch.float32):
    q = torch.randn(b, lq, h, d, generator=gen).to(dtype).transpose(1, 2)  # the [B, n, H, D] cache view
    perm = torch.stack([torch.randperm(lq, generator=gen) for _ in range(b * h)]).view(b, h, lq)
    inv = 127 / q.float().abs().amax((2, 3))
    means = torch.randint(-127, 128, (b, h, nkb, d), generator=gen, dtype=torch.int8)
    logit_scale = torch.rand(b, h, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(b, h, nkb, generator=gen).masked_fill(torch.rand(b, h, nkb, generator=gen) < 0.2, float("-inf"))
    return q, perm, inv, means, logit_scale, bias


def _brute(q, perm, inv, means, logit_scale, bias, block_q):
    b, h, lq, _ = q.shape
    nqb, nkb = -(-lq // block_q), means.shape[2]
    out = torch.full((b, h, nqb, nkb), float("-inf"))
    for bi in range(b):
        for hi in range(h):
            for i in range(nqb):
                rows = perm[bi, hi, i * block_q:(i + 1) * block_q]
                levels = [[max(-127, min(127, int(torch.floor(x * inv[bi, hi] + 0.5)))) for x in q[bi, hi, r].float()]
                          for r in rows.tolist()]
                for j in range(nkb):
                    dot = max(sum(a * int(c) for a, c in zip(row, means[bi, hi, j])) for row in levels)
                    out[bi, hi, i, j] = dot * logit_scale[bi, hi] + bias[bi, hi, j]
    return out


def test_twin_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    case = _case(gen, 1, 2, 11, 8, 5)
    torch.testing.assert_close(quant_block_scores_torch(*case, 4), _brute(*case, 4), rtol=0, atol=0)


def test_quantized_queries_span_the_int8_range():
    gen = torch.Generator().manual_seed(1)
    q, _, inv, *_ = _case(gen, 1, 3, 20, 16, 1)
    levels = quantize_queries(q, inv)
    assert levels.abs().amax((2, 3)).eq(127).all() and levels.eq(levels.round()).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(dtype):
    gen = torch.Generator().manual_seed(2)
    for b, h, lq, d, nkb, block_q in [(1, 1, 1, 16, 1, 64), (2, 3, 70, 16, 67, 64), (1, 2, 33, 32, 130, 16),
                                      (1, 1, 129, 64, 3, 128), (1, 2, 5, 16, 0, 4)]:
        case = _case(gen, b, h, lq, d, nkb, dtype)
        want = quant_block_scores_torch(*case, block_q)
        got = quant_block_scores(*case, block_q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(q_perm=torch.zeros(1, 2, 4, dtype=torch.int32)), "q_perm"),
    (dict(inv_scale=torch.ones(1, 3)), "inv_scale"),
    (dict(key_means=torch.zeros(1, 2, 3, 16)), "key_means"),
    (dict(logit_scale=torch.ones(1, 2, dtype=torch.float64)), "logit_scale"),
    (dict(block_bias=torch.zeros(1, 2, 4)), "block_bias"),
])
def test_bad_inputs_name_the_problem(bad, match):
    args = dict(q=torch.zeros(1, 2, 4, 16), q_perm=torch.zeros(1, 2, 4, dtype=torch.int64),
                inv_scale=torch.ones(1, 2), key_means=torch.zeros(1, 2, 3, 16, dtype=torch.int8),
                logit_scale=torch.ones(1, 2), block_bias=torch.zeros(1, 2, 3))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quant_block_scores_torch(*args.values(), block_q=4)
