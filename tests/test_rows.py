"""The per-head row gather and scatter: the Triton kernels equal their twins, the twins equal
indexing and assigning row by row, and the scatter inverts the gather."""
import pytest
import torch

from comfyui_fastar.kernels.rows import (
    gather_rows,
    gather_rows_auto,
    gather_rows_torch,
    scatter_rows,
    scatter_rows_auto,
    scatter_rows_torch,
)


def _gather_case(seed, dtype, b=2, m=70, h=3, d=16, n=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    buf = (1000 * torch.randn(b, m + 9, h + 2, d, generator=g)).to(device, dtype)
    src = buf[:, 4:m + 4, 1:h + 1]  # a [B, M, H, D] slice of a wider cache buffer
    n = m if n is None else n
    index = torch.stack([torch.stack([torch.randint(0, m, (n,), generator=g) for _ in range(h)]) for _ in range(b)])
    return src, index.to(device)


def test_gather_twin_equals_row_indexing():
    src, index = _gather_case(0, torch.float32, n=50)
    out = gather_rows_torch(src, index)
    assert out.shape == (2, 50, 3, 16) and out.is_contiguous()
    for b in range(2):
        for h in range(3):
            assert torch.equal(out[b, :, h], src[b, index[b, h], h])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("n", [70, 5, 33])
def test_gather_kernel_equals_twin(dtype, n, device):
    src, index = _gather_case(1, dtype, n=n, device=device)
    out = gather_rows(src, index)
    assert out.dtype == src.dtype and torch.equal(out, gather_rows_torch(src, index))


def test_gather_by_a_permutation_in_place_round_trip(device):
    """As the cache re-sorts a layer: gathering by a permutation, then by its inverse, restores it."""
    src, _ = _gather_case(2, torch.bfloat16, device=device)
    before = src.clone()
    perm = torch.stack([torch.stack([torch.randperm(70) for _ in range(3)]) for _ in range(2)]).to(device)
    src.copy_(gather_rows(src, perm))
    assert not torch.equal(src, before)
    src.copy_(gather_rows(src, torch.argsort(perm, dim=-1)))
    assert torch.equal(src, before)


def test_gather_auto_falls_back_and_bad_inputs_raise(device):
    src, index = _gather_case(3, torch.float32, d=12, device=device)  # D not a power of two: the twin
    assert torch.equal(gather_rows_auto(src, index), gather_rows_torch(src, index))
    with pytest.raises(ValueError, match="power of two"):
        gather_rows(src, index)
    src, index = _gather_case(4, torch.float32, device=device)
    for fn in (gather_rows, gather_rows_torch):
        with pytest.raises(ValueError, match="src must be"):
            fn(src[0], index)
        with pytest.raises(ValueError, match="index must be int64"):
            fn(src, index.int())
        with pytest.raises(ValueError, match="index must be int64"):
            fn(src, index[:, :2])


def test_gather_kernel_equals_torch_gather_at_the_budget(device):
    """AnnSA's re-sort of a layer's history (18 frames of rows, natively Wan 1.3B's 28080 x 12 heads)
    in a slice of a cache buffer."""
    chunk = device.chunk
    g = torch.Generator().manual_seed(8)
    hist = 18 * chunk.frame_tokens
    buf = torch.randn(1, 24 * chunk.frame_tokens, chunk.heads, chunk.head_dim, generator=g).to(device, torch.bfloat16)
    part = buf[:, chunk.tokens:chunk.tokens + hist]
    perm = torch.stack([torch.randperm(hist, generator=g) for _ in range(chunk.heads)])[None].to(device)
    assert torch.equal(gather_rows(part, perm), gather_rows_torch(part, perm))


def _scatter_case(seed, dtype, b=2, m=70, h=3, d=16, n=40, device="cpu"):
    """dst: a [B, M, H, D] slice of a wider buffer; index: distinct rows per head; src: a transposed view."""
    g = torch.Generator().manual_seed(seed)
    buf = (1000 * torch.randn(b, m + 9, h + 2, d, generator=g)).to(device, dtype)
    dst = buf[:, 4:m + 4, 1:h + 1]
    index = torch.stack([torch.stack([torch.randperm(m, generator=g)[:n] for _ in range(h)]) for _ in range(b)])
    src = (1000 * torch.randn(b, h, n, d, generator=g)).to(device, dtype).transpose(1, 2)
    return buf, dst, index.to(device), src


def test_scatter_twin_equals_row_assignment():
    buf, dst, index, src = _scatter_case(0, torch.float32)
    want = dst.clone()
    for b in range(2):
        for h in range(3):
            want[b, index[b, h], h] = src[b, :, h]
    outside = buf.clone()
    assert scatter_rows_torch(dst, index, src) is dst
    assert torch.equal(dst, want)
    outside[:, 4:74, 1:4] = want
    assert torch.equal(buf, outside)  # nothing outside the slice moved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("n", [70, 5, 33])
def test_scatter_kernel_equals_twin(dtype, n, device):
    buf, dst, index, src = _scatter_case(1, dtype, n=n, device=device)
    buf2 = buf.clone()
    dst2 = buf2[:, 4:74, 1:4]
    scatter_rows(dst, index, src)
    scatter_rows_torch(dst2, index, src)
    assert torch.equal(buf, buf2)


def test_scatter_inverts_the_gather(device):
    """Rows gathered by a permutation and scattered back by the same permutation restore the region."""
    _, dst, _, _ = _scatter_case(2, torch.bfloat16, device=device)
    before = dst.clone()
    perm = torch.stack([torch.stack([torch.randperm(70) for _ in range(3)]) for _ in range(2)]).to(device)
    moved = gather_rows_torch(dst, perm)
    dst.zero_()
    scatter_rows(dst, perm, moved)
    assert torch.equal(dst, before)


def test_scatter_duplicate_rows_take_one_of_their_writes(device):
    """Rows several sources target (TempCache's dump row) end up holding one of those sources."""
    _, dst, index, src = _scatter_case(3, torch.float32, n=10, device=device)
    index[:, :, 5:] = 0
    scatter_rows(dst, index, src)
    for b in range(2):
        for h in range(3):
            assert any(torch.equal(dst[b, 0, h], src[b, i, h]) for i in range(5, 10))
            assert torch.equal(dst[b, index[b, h, :5], h], src[b, :5, h])


def test_scatter_auto_falls_back_and_bad_inputs_raise(device):
    _, dst, index, src = _scatter_case(4, torch.float32, d=12, device=device)  # D not a power of two: the twin
    want = dst.clone()
    scatter_rows_torch(want, index, src)
    assert torch.equal(scatter_rows_auto(dst, index, src), want)
    with pytest.raises(ValueError, match="power of two"):
        scatter_rows(dst, index, src)
    with pytest.raises(ValueError, match="index must be int64"):
        scatter_rows_torch(dst, index.int(), src)
    with pytest.raises(ValueError, match="src must be"):
        scatter_rows_torch(dst, index, src[:, :3])
    with pytest.raises(ValueError, match="src must be"):
        scatter_rows_torch(dst, index, src.double())
