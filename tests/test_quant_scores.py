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
    quantize_blocks,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")


def _case(gen, b, h, lq, d, nkb, dtype=torch.float32):
    q = torch.randn(b, lq, h, d, generator=gen).to(dtype).transpose(1, 2)  # the [B, n, H, D] cache view
    means = torch.randint(-127, 128, (b, h, nkb, d), generator=gen, dtype=torch.int8)
    logit_scale = torch.rand(b, h, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(b, h, nkb, generator=gen).masked_fill(torch.rand(b, h, nkb, generator=gen) < 0.2, float("-inf"))
    return q, means, logit_scale, bias


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


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(dtype):
    gen = torch.Generator().manual_seed(2)
    for b, h, lq, d, nkb, block_q in [(1, 1, 1, 16, 1, 64), (2, 3, 70, 16, 67, 64), (1, 2, 33, 32, 130, 16),
                                      (1, 1, 129, 64, 3, 128), (1, 2, 5, 16, 0, 4)]:
        case = _case(gen, b, h, lq, d, nkb, dtype)
        case[0][..., :block_q, :] = 0  # an all-zero query block: its scale is clamped, its scores the bias
        want = quant_block_scores_torch(*case, block_q)
        got = quant_block_scores(*case, block_q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


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
