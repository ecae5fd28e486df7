"""Each row's argmax: the twin takes the first index of the maximum, the Triton kernel equals the
twin, ties and all."""
import pytest
import torch

from comfyui_fastar.kernels.row_argmax import row_argmax, row_argmax_auto, row_argmax_torch


def _scores(seed, dtype, r=9, m=5000, device="cpu"):
    """Integer-valued scores (exact in every dtype) with repeated maxima, in a strided view."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(-50, 50, (r, m + 7), generator=g).to(device, dtype)
    s = buf[:, 3:m + 3]
    s[0, [4100, 17, 2049]] = 90  # ties across lanes and blocks: the first wins
    s[1, m - 1] = 95             # the last column
    s[2] = float("-inf")         # nothing finite
    return s


def test_twin_takes_the_first_maximum():
    s = _scores(0, torch.float32)
    got = row_argmax_torch(s)
    assert got.dtype == torch.int64 and got[0] == 17 and got[1] == 4999 and got[2] == 0
    for i in range(3, 9):
        assert got[i] == min(j for j in range(5000) if s[i, j] == s[i].max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [5000, 2048, 7])
def test_kernel_equals_twin(dtype, m, device):
    s = _scores(1, dtype, m=max(m, 5000), device=device)[:, :m]
    if m < 5000:
        s = s.contiguous()
        s[0, 3] = 99
    assert torch.equal(row_argmax(s), row_argmax_torch(s))
    assert torch.equal(row_argmax_auto(s), row_argmax_torch(s))


def test_bad_calls_name_the_problem():
    with pytest.raises(ValueError, match="scores must be"):
        row_argmax_torch(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="floating point"):
        row_argmax_torch(torch.zeros(3, 4, dtype=torch.long))


def test_kernel_equals_twin_on_a_block_of_match_scores(device):
    """A block of the fp8 match's bf16 scores (many exact ties at bf16's resolution): natively 1024
    new tokens against Wan 1.3B's 28080 history tokens."""
    chunk = device.chunk
    g = torch.Generator().manual_seed(10)
    s = (torch.randn(device.pick(64, 1024), 18 * chunk.frame_tokens, generator=g) * 4096).to(device, torch.bfloat16)
    s[::7, 5] = 1e6
    assert torch.equal(row_argmax(s), row_argmax_torch(s))
    assert torch.equal(row_argmax(s[:, 1:]), row_argmax_torch(s[:, 1:]))
