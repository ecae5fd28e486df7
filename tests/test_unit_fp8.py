"""The fp8 operands of TempCache's match: the twin's rows are the tokens (through the head
alignment) at unit norm x 256, empty and padding rows zero; the kernel equals the twin on a GPU
(Triton's interpreter rounds to e4m3 otherwise than the GPU does)."""
import pytest
import torch

from comfyui_fastar.kernels.unit_fp8 import UNIT, unit_fp8, unit_fp8_torch

E4M3_STEP = 2.0 ** -3  # relative spacing of e4m3 values (3 mantissa bits)


def _case(seed, m=37, h=3, d=8):
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(m + 5, h + 1, d, generator=g) * torch.rand(m + 5, 1, 1, generator=g) * 5).bfloat16()
    src = buf[2:m + 2, :h]  # a strided [M, H, D] view
    index = torch.stack([torch.randperm(m, generator=g) for _ in range(h)])
    held = torch.rand(m, generator=g) > 0.2
    return src, index, held


def test_rows_are_unit_tokens_times_256():
    src, _, _ = _case(0)
    out = unit_fp8_torch(src, m_out=48)
    assert out.shape == (48, 24) and out.dtype == torch.float8_e4m3fn
    got = out.float()
    want = src.float().reshape(37, 24)
    want = UNIT * want / want.norm(dim=-1, keepdim=True)
    assert ((got[:37] - want).abs() <= E4M3_STEP * want.abs() + 2 ** -9).all()
    assert got[37:].eq(0).all()  # padding rows


def test_alignment_and_empty_rows():
    src, index, held = _case(1)
    out = unit_fp8_torch(src, index, held).float()
    aligned = torch.stack([src[index[i], i] for i in range(3)], dim=1)  # token m of head h
    assert torch.equal(out, unit_fp8_torch(aligned, held=held).float())
    assert out[~held].eq(0).all() and out[held].ne(0).any(-1).all()


@pytest.mark.parametrize("bad, match", [
    (dict(src=torch.zeros(4, 8)), "src must be"),
    (dict(index=torch.zeros(2, 4, dtype=torch.long)), "index must be"),
    (dict(held=torch.ones(5, dtype=torch.bool)), "held must be"),
    (dict(m_out=3), "m_out"),
])
def test_bad_inputs_raise(bad, match):
    args = dict(src=torch.zeros(4, 3, 8), index=None, held=None, m_out=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        unit_fp8_torch(**args)


@pytest.mark.cuda
def test_kernel_equals_its_twin(device):
    """The history's side at the budget (natively Wan 1.3B's 28080 tokens, heads lined up through a
    per-head order, empty slots), the chunk's side (no order) and odd sizes: the same fp8 values up
    to one rounding step where the fp32 norms differ in their last bit."""
    chunk = device.chunk
    g = torch.Generator(device=device).manual_seed(6)
    for m, h, d, aligned in ((18 * chunk.frame_tokens, chunk.heads, chunk.head_dim, True),
                             (chunk.tokens, chunk.heads, chunk.head_dim, False), (37, 3, 16, True)):
        src = (torch.randn(m + 3, h, d, device=device, generator=g) * 3)[2:m + 2].bfloat16()
        index = torch.stack([torch.randperm(m, device=device, generator=g) for _ in range(h)]) if aligned else None
        held = torch.rand(m, device=device, generator=g) > 0.1 if aligned else None
        m_out = -(-m // 16) * 16
        got, want = unit_fp8(src, index, held, m_out).float(), unit_fp8_torch(src, index, held, m_out).float()
        assert got.shape == want.shape == (m_out, h * d)
        assert (got - want).abs().le(E4M3_STEP * want.abs()).all()
        assert (got != want).float().mean().item() < 1e-3
        assert got[m:].eq(0).all()
