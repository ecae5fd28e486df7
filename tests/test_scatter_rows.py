"""The per-head row scatter: the Triton kernel equals its twin, the twin equals assigning row by
row, and it inverts the row gather."""
import pytest
import torch

from comfyui_fastar.kernels.gather_rows import gather_rows_torch
from comfyui_fastar.kernels.scatter_rows import scatter_rows, scatter_rows_auto, scatter_rows_torch


def _case(seed, dtype, b=2, m=70, h=3, d=16, n=40, device="cpu"):
    """dst: a [B, M, H, D] slice of a wider buffer; index: distinct rows per head; src: a transposed view."""
    g = torch.Generator().manual_seed(seed)
    buf = (1000 * torch.randn(b, m + 9, h + 2, d, generator=g)).to(device, dtype)
    dst = buf[:, 4:m + 4, 1:h + 1]
    index = torch.stack([torch.stack([torch.randperm(m, generator=g)[:n] for _ in range(h)]) for _ in range(b)])
    src = (1000 * torch.randn(b, h, n, d, generator=g)).to(device, dtype).transpose(1, 2)
    return buf, dst, index.to(device), src


def test_twin_equals_row_assignment():
    buf, dst, index, src = _case(0, torch.float32)
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
def test_kernel_equals_twin(dtype, n, device):
    buf, dst, index, src = _case(1, dtype, n=n, device=device)
    buf2 = buf.clone()
    dst2 = buf2[:, 4:74, 1:4]
    scatter_rows(dst, index, src)
    scatter_rows_torch(dst2, index, src)
    assert torch.equal(buf, buf2)


def test_inverts_the_gather(device):
    """Rows gathered by a permutation and scattered back by the same permutation restore the region."""
    _, dst, _, _ = _case(2, torch.bfloat16, device=device)
    before = dst.clone()
    perm = torch.stack([torch.stack([torch.randperm(70) for _ in range(3)]) for _ in range(2)]).to(device)
    moved = gather_rows_torch(dst, perm)
    dst.zero_()
    scatter_rows(dst, perm, moved)
    assert torch.equal(dst, before)


def test_duplicate_rows_take_one_of_their_writes(device):
    """Rows several sources target (TempCache's dump row) end up holding one of those sources."""
    _, dst, index, src = _case(3, torch.float32, n=10, device=device)
    index[:, :, 5:] = 0
    scatter_rows(dst, index, src)
    for b in range(2):
        for h in range(3):
            assert any(torch.equal(dst[b, 0, h], src[b, i, h]) for i in range(5, 10))
            assert torch.equal(dst[b, index[b, h, :5], h], src[b, :5, h])


def test_auto_falls_back_and_bad_inputs_raise(device):
    _, dst, index, src = _case(4, torch.float32, d=12, device=device)  # D not a power of two: the twin
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
