"""Fused q/k RMS norm + RoPE: twin vs an independent complex-number reference, kernel vs twin."""

import pytest
import torch
import torch.nn.functional as F

from comfyui_fastar.fastar.models.rope import rope_frequencies
from comfyui_fastar.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_auto, qk_norm_rope_torch


def _reference(x, weight, freqs, heads, eps):
    """rms_norm, then each channel pair as a complex number times exp(i * angle)."""
    y = F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps) if weight is not None else x.double()
    y = torch.view_as_complex(y.unflatten(-1, (heads, -1, 2)).contiguous())
    rot = torch.polar(torch.ones_like(freqs[..., 0]).double(), torch.atan2(freqs[..., 1], freqs[..., 0]).double())
    return torch.view_as_real(y * rot[None, :, None]).flatten(-2)


def _case(gen, b, length, heads, d, dtype, offset=0, device="cpu"):
    x = torch.randn(b, length, heads * d, generator=gen).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(heads * d, generator=gen)).to(device, dtype)
    freqs = rope_frequencies(d, (length, 1, 1), offset).to(device)
    return x, weight, freqs


@pytest.mark.parametrize("norm", [True, False])
def test_twin_matches_complex_rotation(norm):
    gen = torch.Generator().manual_seed(0)
    x, weight, freqs = _case(gen, 2, 5, 3, 12, torch.float32, offset=7)
    w = weight if norm else None
    got = qk_norm_rope_torch(x, w, freqs, 3, 1e-6)
    torch.testing.assert_close(got.double(), _reference(x, w, freqs, 3, 1e-6), rtol=1e-5, atol=1e-5)


def test_rotation_keeps_pair_norms_and_offset_zero_frame_is_identity():
    gen = torch.Generator().manual_seed(1)
    x, _, _ = _case(gen, 1, 4, 2, 8, torch.float32)
    freqs = rope_frequencies(8, (1, 2, 2), 0)  # frame 0, rows/cols 0..1: token 0 has all angles 0
    out = qk_norm_rope_torch(x, None, freqs, 2)
    torch.testing.assert_close(out[0, 0].flatten(), x[0, 0])
    pairs = lambda t: t.reshape(*t.shape[:2], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(out.flatten(2)), pairs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_matches_twin(dtype, norm, device):
    """Odd and tiny shapes (B, L, H, D) and the device's chunk: Wan 1.3B's 4680 tokens of 12 heads
    of 128 natively."""
    gen = torch.Generator().manual_seed(2)
    chunk = device.chunk
    for b, length, heads, d in [(1, 1, 1, 2), (2, 7, 3, 16), (1, 5, 12, 8), (1, 3, 5, 32), (2, 37, 3, 24),
                                (1, 5, 1, 2), (1, chunk.tokens, chunk.heads, chunk.head_dim)]:
        x, weight, freqs = _case(gen, b, length, heads, d, dtype, offset=3, device=device)
        w = weight if norm else None
        want = qk_norm_rope_torch(x, w, freqs, heads, 1e-6)
        got = qk_norm_rope(x, w, freqs, heads, 1e-6)
        assert got.shape == (b, length, heads, d) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kernel_reads_strided_rows(device):
    gen = torch.Generator().manual_seed(3)
    base, weight, freqs = _case(gen, 2, 6, 4, 8, torch.float32, device=device)
    x = torch.cat([base, base], dim=-1)[..., ::2]  # channel stride 2, rows not contiguous
    torch.testing.assert_close(qk_norm_rope(x, weight, freqs, 4), qk_norm_rope_torch(x, weight, freqs, 4))


def test_kernel_and_twin_write_into_the_cache_rows_given(device):
    """``out`` as the KV cache's rows of an open chunk: a [B, n, H, D] slice of a longer buffer
    (batch stride past n rows); rows outside it stay untouched."""
    gen = torch.Generator().manual_seed(6)
    x, weight, freqs = _case(gen, 2, 5, 3, 8, torch.float32, offset=2, device=device)
    want = qk_norm_rope_torch(x, weight, freqs, 3)
    for fn in (qk_norm_rope, qk_norm_rope_torch):
        cache = torch.full((2, 9, 3, 8), 7.0, device=device)
        rows = cache[:, 2:7]
        assert fn(x, weight, freqs, 3, out=rows) is rows
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
        assert cache[:, :2].eq(7).all() and cache[:, 7:].eq(7).all()
    with pytest.raises(ValueError, match="out must be"):
        qk_norm_rope(x, weight, freqs, 3, out=torch.empty(2, 5, 3, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rope_torch(x, weight, freqs, 3, out=torch.empty(2, 5, 8, 3, device=device).transpose(2, 3))


def test_kernel_and_twin_write_heads_apart(device):
    """``out`` as TempCache's folded keys: each head's D channels followed by 16 the kernel must not
    touch (the folded bias)."""
    gen = torch.Generator().manual_seed(8)
    x, weight, freqs = _case(gen, 2, 5, 3, 8, torch.float32, device=device)
    want = qk_norm_rope_torch(x, weight, freqs, 3)
    for fn in (qk_norm_rope, qk_norm_rope_torch):
        folded = torch.full((2, 5, 3, 24), 7.0, device=device)
        rows = folded[..., :8]
        assert fn(x, weight, freqs, 3, out=rows) is rows
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
        assert folded[..., 8:].eq(7).all()


def test_kernel_takes_any_even_head_dim(device):
    gen = torch.Generator().manual_seed(4)
    x, weight, freqs = _case(gen, 1, 9, 3, 12, torch.float32, device=device)  # D/2 = 6, C = 36: neither a power of two
    torch.testing.assert_close(qk_norm_rope(x, weight, freqs, 3), qk_norm_rope_torch(x, weight, freqs, 3))


def test_auto_runs_the_twin_on_cpu():
    gen = torch.Generator().manual_seed(5)
    x, weight, freqs = _case(gen, 1, 3, 2, 12, torch.float32)
    torch.testing.assert_close(qk_norm_rope_auto(x, weight, freqs, 2), qk_norm_rope_torch(x, weight, freqs, 2),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 8)), "x must be"),
    (dict(heads=3), "heads of even size"),
    (dict(weight=torch.ones(5)), "weight must be"),
    (dict(freqs=torch.zeros(4, 3, 2)), "freqs must be"),
])
def test_bad_inputs_name_the_problem(bad, match):
    args = dict(x=torch.zeros(1, 4, 16), weight=torch.ones(16), freqs=torch.zeros(4, 4, 2), heads=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        qk_norm_rope_torch(args["x"], args["weight"], args["freqs"], args["heads"])
