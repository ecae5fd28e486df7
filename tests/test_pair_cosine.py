"""The matched pair's cosine over all heads: the twin equals cosine_similarity of the concatenated
heads, the Triton kernel equals the twin."""
import pytest
import torch

from comfyui_fastar.kernels.pair_cosine import pair_cosine, pair_cosine_auto, pair_cosine_torch


def _case(seed, dtype, n=37, m=50, h=3, d=16, device="cpu"):
    """x: a transposed view; src: a strided slice of a wider buffer; rows: each head its own order."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(h, n, d, generator=g) * 3).to(device, dtype).transpose(0, 1)
    src = (torch.randn(m + 4, h + 2, d, generator=g) * torch.rand(m + 4, 1, 1, generator=g)).to(device, dtype)
    rows = torch.randint(0, m, (h, n), generator=g).to(device)
    return x, src[2:m + 2, 1:h + 1], rows


def test_twin_is_the_cosine_of_the_concatenated_heads():
    x, src, rows = _case(0, torch.float32)
    y = torch.stack([src[rows[h], h] for h in range(3)], dim=1)                # [N, H, D]
    want = torch.nn.functional.cosine_similarity(x.reshape(37, -1).double(), y.reshape(37, -1).double(), dim=-1)
    got = pair_cosine_torch(x, src, rows)
    assert got.dtype == torch.float32 and got.shape == (37,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # a token paired with itself: cosine 1; a zero row: 0, not nan
    same = torch.arange(37).expand(3, 37)
    torch.testing.assert_close(pair_cosine_torch(src[:37], src, same), torch.ones(37), rtol=1e-6, atol=1e-6)
    assert pair_cosine_torch(torch.zeros_like(x), src, rows).eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 5, 16])
def test_kernel_equals_twin(dtype, n, device):
    x, src, rows = _case(1, dtype, n=n, device=device)
    got, want = pair_cosine(x, src, rows), pair_cosine_torch(x, src, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pair_cosine_auto(x, src, rows), want, rtol=1e-5, atol=1e-6)


def test_bad_calls_name_the_problem():
    x, src, rows = _case(2, torch.float32)
    with pytest.raises(ValueError, match="rows must be int64"):
        pair_cosine_torch(x, src, rows.int())
    with pytest.raises(ValueError, match="rows must be int64"):
        pair_cosine_torch(x, src, rows[:, :5])
    with pytest.raises(ValueError, match="x and src must be"):
        pair_cosine_torch(x, src[..., :8], rows)


def test_kernel_equals_twin_at_the_chunk_shape(device):
    """A chunk's tokens against a history at the budget, each head its own slot order (natively Wan
    1.3B's 4680 tokens against 28080), the first 100 paired with themselves: cosine 1."""
    chunk = device.chunk
    g = torch.Generator().manual_seed(8)
    hist = 18 * chunk.frame_tokens
    x = torch.randn(chunk.tokens, chunk.heads, chunk.head_dim, generator=g).to(device, torch.bfloat16)
    src = (torch.randn(hist + 1, chunk.heads, chunk.head_dim, generator=g) * 2).to(device, torch.bfloat16)[1:]
    rows = torch.randint(0, hist, (chunk.heads, chunk.tokens), generator=g).to(device)
    rows[:, :100] = torch.arange(100, device=device)
    x[:100] = src[:100]  # pairs of a token with itself
    got, want = pair_cosine(x, src, rows), pair_cosine_torch(x, src, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:100], torch.ones(100, device=device), rtol=1e-5, atol=1e-6)
