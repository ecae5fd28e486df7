"""Top-1 correspondence: torch twin vs brute force, and Triton kernel vs twin."""

import random

import pytest
import torch

from comfyui_fastar.kernels import correspondence as corr
from comfyui_fastar.kernels.correspondence import (
    top1_correspondence,
    top1_correspondence_torch,
    top1_correspondence_triton,
)

RTOL = 1e-5
ATOL = 1e-5
BIG = torch.iinfo(torch.int64).max


def _full_scores(x, keys, key_len):
    """The whole [G, N, key_len] score matrix in float64: the brute-force oracle."""
    return torch.bmm(x.double(), keys[:, :key_len].double().transpose(1, 2))


def _brute_top1(x, keys, key_len):
    """Max and smallest argmax over the full matrix."""
    s = _full_scores(x, keys, key_len)
    smax = s.amax(-1)
    cols = torch.arange(key_len)
    idx = torch.where(s == smax.unsqueeze(-1), cols, BIG).amin(-1)
    return idx, smax, s


def _assert_matches(idx, score, x, keys, key_len, exact):
    """Check (idx, score) against brute force.

    exact: integer-valued data, where every dot product is exactly representable, so
    index (smallest on ties) and score must match bit for bit. Otherwise scores must be
    close, and the index must be the true argmax wherever the top two scores are more
    than the rounding tolerance apart; inside that band any near-maximal key is fine,
    but such rows must stay rare so the test cannot pass by excusing everything.
    """
    idx, score, x, keys = (t.cpu() for t in (idx, score, x, keys))
    ref_idx, ref_max, s = _brute_top1(x, keys, key_len)
    assert idx.dtype == torch.int64 and score.dtype == torch.float32
    assert idx.shape == ref_idx.shape and score.shape == ref_max.shape
    if exact:
        assert torch.equal(idx, ref_idx)
        assert torch.equal(score.double(), ref_max)
        return
    torch.testing.assert_close(score.double(), ref_max, rtol=RTOL, atol=ATOL)
    tol = ATOL + RTOL * ref_max.abs()
    picked = s.gather(-1, idx.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    assert bool((idx >= 0).all() and (idx < key_len).all())
    assert bool(((ref_max - picked) <= tol).all()), "picked a key that is not a maximiser"
    if key_len >= 2:
        top2 = s.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > tol
    else:
        clear = torch.ones_like(ref_max, dtype=torch.bool)
    assert torch.equal(idx[clear], ref_idx[clear])
    assert (~clear).sum().item() <= max(1, clear.numel() // 100), "too many near-ties"


def _make(g, n, m, d, dtype, integer, gen, device="cpu"):
    if integer:
        # Small integers: exact in bf16/fp16 and every dot is exact in fp32 -> real ties.
        x = torch.randint(-3, 4, (g, n, d), generator=gen).to(device, dtype)
        k = torch.randint(-3, 4, (g, m, d), generator=gen).to(device, dtype)
    else:
        x = torch.randn(g, n, d, generator=gen).to(device, dtype)
        k = torch.randn(g, m, d, generator=gen).to(device, dtype)
    return x, k


# --------------------------------------------------------------------------- twin


@pytest.mark.parametrize("block_keys", [1, 7, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("integer", [False, True])
def test_twin_matches_brute_force(block_keys, dtype, integer):
    gen = torch.Generator().manual_seed(1234)
    x, k = _make(3, 19, 150, 32, dtype, integer, gen)
    for key_len in (None, 1, 97):
        idx, score = top1_correspondence_torch(x, k, key_len, block_keys=block_keys)
        _assert_matches(idx, score, x, k, 150 if key_len is None else key_len, exact=integer)


def test_twin_streams_key_blocks(monkeypatch):
    """Peak score block is [G, N, block_keys], never the full [G, N, M] matrix."""
    widths = []
    real_bmm = torch.bmm

    def spy(a, b):
        widths.append(b.shape[-1])
        return real_bmm(a, b)

    monkeypatch.setattr(torch, "bmm", spy)
    x, k = _make(2, 5, 300, 32, torch.float32, False, torch.Generator().manual_seed(0))
    top1_correspondence_torch(x, k, 250, block_keys=64)
    assert widths == [64, 64, 64, 58]


# --------------------------------------------------------------------------- kernel


def _random_case(seed, device):
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    g = rnd.randint(1, 3)
    n = 1 if rnd.random() < 0.15 else rnd.randint(2, 80)
    m = 1 if rnd.random() < 0.15 else rnd.randint(2, 200)
    key_len = rnd.choice([None, m, rnd.randint(1, m), rnd.randint(1, m)])
    d = rnd.choice([32, 64])
    dtype = rnd.choices([torch.float32, torch.bfloat16, torch.float16], weights=[2, 2, 1])[0]
    integer = rnd.random() < 0.3
    blocks = {"block_n": rnd.choice([16, 32, 64]), "block_m": rnd.choice([16, 32, 64])}
    x, k = _make(g, n, m, d, dtype, integer, gen, device)
    if rnd.random() < 0.3:
        # keys as the live prefix of a larger preallocated cache (non-contiguous view).
        buf = torch.zeros(g, m + 13, d, dtype=dtype, device=device)
        buf[:, :m] = k
        k = buf[:, :m]
    return x, k, key_len, blocks, integer


@pytest.mark.parametrize("seed", range(36))
def test_kernel_matches_twin_random(seed, device):
    x, k, key_len, blocks, integer = _random_case(seed, device)
    kl = k.shape[1] if key_len is None else key_len
    t_idx, t_score = top1_correspondence_torch(x, k, key_len, block_keys=37)
    k_idx, k_score = top1_correspondence_triton(x, k, key_len, **blocks)
    _assert_matches(t_idx, t_score, x, k, kl, exact=integer)
    _assert_matches(k_idx, k_score, x, k, kl, exact=integer)
    if integer:
        # Every dot is exact, so summation order cannot matter: outputs are identical.
        assert torch.equal(k_idx, t_idx) and torch.equal(k_score, t_score)


def test_kernel_strided_views_read_in_place(device):
    """A [M, H, D] cache permuted to groups [H, M, D], and a permuted x, need no copy."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randint(-3, 4, (90, 4, 32), generator=gen).float().to(device)  # [M, H, D]
    keys = cache.permute(1, 0, 2)  # [H, M, D], strides (D, H*D, 1)
    xbuf = torch.randint(-3, 4, (21, 4, 32), generator=gen).float().to(device)  # [N, H, D]
    x = xbuf.permute(1, 0, 2)
    assert not keys.is_contiguous() and not x.is_contiguous()
    t = top1_correspondence_torch(x, keys, 70)
    kk = top1_correspondence_triton(x, keys, 70, block_n=16, block_m=16)
    _assert_matches(*kk, x, keys, 70, exact=True)
    assert torch.equal(t[0], kk[0]) and torch.equal(t[1], kk[1])


def test_kernel_mixed_dtypes(device):
    x, _ = _make(2, 9, 1, 64, torch.bfloat16, False, torch.Generator().manual_seed(3), device)
    _, k = _make(2, 1, 50, 64, torch.float32, False, torch.Generator().manual_seed(4), device)
    _assert_matches(*top1_correspondence_triton(x, k, block_m=16), x, k, 50, exact=False)


# --------------------------------------------------------------------------- ties / empty


def _tie_case(dtype, positions, device, m=80, d=32):
    """Keys at `positions` are identical and the unique maximisers for every query.

    Queries are one +-1 vector q; the duplicated key is 2q (score 2d) and every other key
    has entries in {-1, 0, 1} (score <= d). All values are exact in fp32 and bf16.
    """
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(0, 2, (2, 1, d), generator=gen) * 2 - 1
    k = torch.randint(-1, 2, (2, m, d), generator=gen)
    k[:, positions] = 2 * q
    return q.expand(2, 10, d).to(device, dtype), k.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[5, 40, 70], [3, 9], [17, 16]])
def test_ties_go_to_smallest_index(dtype, positions, device):
    x, k = _tie_case(dtype, positions, device)
    want = min(positions)
    results = [top1_correspondence_torch(x, k, block_keys=bk) for bk in (1, 16, 1024)]
    results += [top1_correspondence_triton(x, k, block_n=16, block_m=bm) for bm in (16, 64)]
    results.append(top1_correspondence(x, k))
    for idx, score in results:
        assert bool((idx == want).all()), idx
        assert bool((score == 2 * 32).all())


def test_all_keys_equal_gives_index_zero(device):
    x = torch.ones(1, 4, 32, device=device)
    k = torch.ones(1, 50, 32, device=device)
    fns = [lambda: top1_correspondence_torch(x, k, block_keys=8), lambda: top1_correspondence_triton(x, k, block_m=16)]
    for fn in fns:
        idx, score = fn()
        assert bool((idx == 0).all()) and bool((score == 32).all())


@pytest.mark.parametrize("m", [0, 5])
def test_key_len_zero_returns_sentinels(m, device):
    x = torch.randn(2, 3, 32, device=device)
    k = torch.randn(2, m, 32, device=device)
    for fn in (top1_correspondence_torch, top1_correspondence, top1_correspondence_triton):
        idx, score = fn(x, k, 0)
        assert idx.dtype == torch.int64 and score.dtype == torch.float32
        assert bool((idx == -1).all()) and bool(torch.isneginf(score).all())
        assert idx.shape == (2, 3)


def test_dispatch_takes_the_kernel_where_triton_runs(device, monkeypatch):
    def twin(*args):
        raise AssertionError("the dispatcher took the twin")

    monkeypatch.setattr(corr, "top1_correspondence_torch", twin)
    x, k = _make(2, 7, 33, 32, torch.float32, True, torch.Generator().manual_seed(5), device)
    idx, score = top1_correspondence(x, k, 30)
    _assert_matches(idx, score, x, k, 30, exact=True)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn", [top1_correspondence_torch, top1_correspondence, top1_correspondence_triton])
@pytest.mark.parametrize(
    "x_shape, k_shape, key_len, match",
    [
        ((2, 3, 32), (2, 5, 64), None, "D mismatch"),
        ((2, 3, 32), (3, 5, 32), None, "G mismatch"),
        ((3, 32), (2, 5, 32), None, "x must be 3-D"),
        ((2, 3, 32), (2, 1, 5, 32), None, "keys must be 3-D"),
        ((2, 3, 32), (2, 5, 32), 6, "key_len=6 out of range"),
        ((2, 3, 32), (2, 5, 32), -1, "key_len=-1 out of range"),
    ],
)
def test_bad_input_raises(fn, x_shape, k_shape, key_len, match, device):
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(x_shape, device=device), torch.zeros(k_shape, device=device), key_len)


def test_kernel_rejects_unsupported_head_dim_and_blocks(device):
    with pytest.raises(ValueError, match="power of two"):
        top1_correspondence_triton(torch.zeros(1, 2, 24, device=device), torch.zeros(1, 3, 24, device=device))
    with pytest.raises(ValueError, match="block_m"):
        top1_correspondence_triton(torch.zeros(1, 2, 32, device=device), torch.zeros(1, 3, 32, device=device),
                                   block_m=8)
    # The dispatcher falls back to the twin for head dims the kernel cannot tile.
    idx, _ = top1_correspondence(torch.ones(1, 2, 24, device=device), torch.ones(1, 3, 24, device=device))
    assert bool((idx == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_scale_gives_cosine_argmax(dtype, device):
    """key_scale = 1/|k| turns the dot-product argmax into the cosine argmax (TempCache's
    matching); zero-scaled keys (empty cache slots) score 0."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 37, 32, generator=g).to(dtype)
    keys = (torch.randn(2, 90, 32, generator=g) * torch.rand(2, 90, 1, generator=g) * 5).to(dtype)
    scale = 1.0 / keys.float().norm(dim=-1)
    scale[:, 80:] = 0.0
    cos = torch.bmm(x.double(), keys.double().transpose(1, 2)) * scale.double()[:, None, :]
    ref_score, ref_idx = cos.max(-1)
    t_idx, t_score = top1_correspondence_torch(x, keys, None, scale, block_keys=16)
    torch.testing.assert_close(t_score.double(), ref_score, rtol=1e-5, atol=1e-5)
    assert torch.equal(t_idx, ref_idx)
    x, keys, scale = x.to(device), keys.to(device), scale.to(device)
    k_idx, k_score = top1_correspondence_triton(x, keys, None, scale, block_n=16, block_m=32)
    torch.testing.assert_close(k_score.cpu(), t_score, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_idx.cpu(), t_idx)
    with pytest.raises(ValueError, match="key_scale must be float32"):
        top1_correspondence_torch(x, keys, None, scale[:, :5])
