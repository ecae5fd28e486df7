"""AnnSA's block means: the Triton kernel equals its twin, and the twin equals a per-block loop over
the filled keys."""
import pytest
import torch

from comfyui_fastar.kernels.block_means import block_means, block_means_auto, block_means_torch


def _case(seed, dtype, b=2, m=300, h=3, d=16, view=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if view:  # a [B, M, H, D] slice of a wider buffer, as the cache hands it over
        k = torch.randn(b, m + 7, h + 2, d, generator=g).to(device, dtype)[:, 3:m + 3, 1:h + 1]
    else:
        k = torch.randn(b, m, h, d, generator=g).to(device, dtype)
    filled = (torch.rand(b, h, m, generator=g) > 0.3).to(device)
    filled[0, 1, :128] = False  # whole empty blocks
    return k, filled


def test_twin_equals_a_loop_over_blocks():
    k, filled = _case(0, torch.float32)
    mean, count = block_means_torch(k, filled, 64)
    for b in range(2):
        for h in range(3):
            for j in range(mean.shape[2]):
                rows = torch.arange(j * 64, min((j + 1) * 64, 300))
                keep = rows[filled[b, h, rows]]
                assert count[b, h, j] == len(keep)
                want = k[b, keep, h].sum(0) / max(len(keep), 1)
                torch.testing.assert_close(mean[b, h, j], want, rtol=1e-5, atol=1e-6)
    assert bool((mean[0, 1, :2] == 0).all()) and bool((count[0, 1, :2] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("block", [64, 128])
def test_kernel_equals_twin(dtype, view, block, device):
    k, filled = _case(1, dtype, view=view, device=device)
    mean, count = block_means(k, filled, block)
    want_mean, want_count = block_means_torch(k, filled, block)
    assert mean.shape == want_mean.shape == (2, 3, -(-300 // block), 16)
    assert torch.equal(count, want_count)
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-6)


def test_auto_takes_the_twin_where_the_kernel_cannot_run(device):
    k, filled = _case(2, torch.float32, d=12, device=device)  # D not a power of two
    mean, count = block_means_auto(k, filled, 64)
    want = block_means_torch(k, filled, 64)
    assert torch.equal(mean, want[0]) and torch.equal(count, want[1])
    with pytest.raises(ValueError, match="powers of two"):
        block_means(k, filled, 64)


@pytest.mark.parametrize("fn", [block_means_torch, block_means])
def test_bad_inputs_raise(fn, device):
    k, filled = _case(3, torch.float32, device=device)
    with pytest.raises(ValueError, match="k must be"):
        fn(k[0], filled, 64)
    with pytest.raises(ValueError, match="filled must be bool"):
        fn(k, filled.float(), 64)
    with pytest.raises(ValueError, match="filled must be bool"):
        fn(k, filled[:, :, :10], 64)
    with pytest.raises(ValueError, match="block must be"):
        fn(k, filled, 0)


@pytest.mark.parametrize("fn", [block_means_torch, block_means])
def test_no_mask_and_a_slice_of_a_buffer_as_out(fn, device):
    """``filled=None`` reads every row; ``out`` takes a slice of a larger buffer (AnnSA writes the
    open chunk's blocks behind the sink's) and leaves the rest of it as it was."""
    k, _ = _case(4, torch.bfloat16, view=True, device=device)
    want_mean, want_count = block_means_torch(k, torch.ones(2, 3, 300, dtype=torch.bool, device=device), 64)
    buf, counts = torch.full((2, 3, 7, 16), 7.0, device=device), torch.full((2, 3, 7), 7.0, device=device)
    mean, count = fn(k, None, 64, out=(buf[:, :, 2:], counts[:, :, 2:]))
    assert mean.data_ptr() == buf[:, :, 2:].data_ptr() and count.data_ptr() == counts[:, :, 2:].data_ptr()
    torch.testing.assert_close(buf[:, :, 2:], want_mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts[:, :, 2:], want_count) and bool((buf[:, :, :2] == 7).all() and (counts[:, :, :2] == 7).all())
    # outputs strided every way (head-major buffers seen transposed) take the same values
    tbuf = torch.zeros(16, 5, 3, 2, device=device).permute(3, 2, 1, 0)
    tcounts = torch.zeros(5, 3, 2, device=device).permute(2, 1, 0)
    fn(k, None, 64, out=(tbuf, tcounts))
    torch.testing.assert_close(tbuf, want_mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(tcounts, want_count)
    with pytest.raises(ValueError, match="out must be fp32"):
        fn(k, None, 64, out=(buf[:, :, 3:], counts[:, :, 3:]))


def test_kernel_equals_twin_at_the_budget(device):
    """A layer's history at the TempCache budget (18 frames of keys, natively Wan 1.3B's 28080 keys
    x 12 heads) as a slice of a [B, L, H, D] cache buffer, a tenth of the slots empty."""
    chunk = device.chunk
    g = torch.Generator().manual_seed(7)
    hist = 18 * chunk.frame_tokens
    buf = torch.randn(1, 24 * chunk.frame_tokens, chunk.heads, chunk.head_dim, generator=g).to(device, torch.bfloat16)
    k = buf[:, chunk.tokens:chunk.tokens + hist]
    filled = (torch.rand(1, chunk.heads, hist, generator=g) > 0.1).to(device)
    mean, count = block_means(k, filled, 128)
    want_mean, want_count = block_means_torch(k, filled, 128)
    assert torch.equal(count, want_count)
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-5)
