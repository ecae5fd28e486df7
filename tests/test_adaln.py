"""Residual + LayerNorm + modulation: twin vs the eager ops it replaces, kernel vs twin."""

import pytest
import torch
import torch.nn.functional as F

from comfyui_fastar.kernels.adaln import adaln, adaln_auto, adaln_torch


def _case(gen, b, f, s, c, t, dtype, device="cpu"):
    x = torch.randn(b, f, s, c, generator=gen).to(device, dtype)
    y = torch.randn(b, f, s, c, generator=gen).to(device, dtype)
    gate, scale, shift = (torch.randn(b, t, c, generator=gen).to(device, dtype) for _ in range(3))
    return x, y, gate, scale, shift


def test_twin_equals_the_eager_block_ops():
    """The twin is the Wan block's own sequence: gated residual, LayerNorm, modulation (or affine),
    in fp32 (here compared in fp64, so to fp32's precision)."""
    gen = torch.Generator().manual_seed(0)
    x, y, gate, scale, shift = _case(gen, 2, 3, 5, 16, 3, torch.float64)
    r, h = adaln_torch(x, scale, shift, y=y, gate=gate)
    want_r = torch.addcmul(x, y, gate.unsqueeze(2))
    want_h = torch.addcmul(shift.unsqueeze(2), F.layer_norm(want_r, (16,), eps=1e-6), 1 + scale.unsqueeze(2))
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    w, bias = torch.randn(16, generator=gen).double(), torch.randn(16, generator=gen).double()
    r, h = adaln_torch(x, w, bias, y=y, one_plus=False, eps=1e-5)
    torch.testing.assert_close(r, x + y)
    torch.testing.assert_close(h, F.layer_norm(x + y, (16,), w, bias, eps=1e-5), rtol=1e-5, atol=1e-5)
    r, h = adaln_torch(x, scale[:, :1], shift[:, :1])  # no residual; one modulation for all frames
    assert r is x
    torch.testing.assert_close(h, F.layer_norm(x, (16,), eps=1e-6) * (1 + scale[:, :1, None]) + shift[:, :1, None],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_twin(dtype, device):
    """Odd and tiny shapes (B, F, S, C, T), Wan 1.3B's C, and the device's chunk: [1, 3, 1560, 1536]
    modulated per frame natively."""
    gen = torch.Generator().manual_seed(1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    chunk = device.chunk
    cases = [(1, 1, 1, 8, 1), (2, 3, 5, 24, 3), (1, 3, 7, 40, 1), (2, 1, 9, 64, 1), (1, 2, 3, 1536, 2),
             (2, 2, 37, 96, 1), (1, 1, 5, 40, 1), (1, chunk.frames, chunk.frame_tokens, chunk.dim, chunk.frames)]
    for b, f, s, c, t in cases:
        x, y, gate, scale, shift = _case(gen, b, f, s, c, t, dtype, device)
        for kw in ({}, {"y": y}, {"y": y, "gate": gate}):
            for one_plus in (True, False):
                got = adaln(x, scale, shift, one_plus=one_plus, **kw)
                want = adaln_torch(x, scale, shift, one_plus=one_plus, **kw)
                for g, w in zip(got, want):
                    assert g.dtype == dtype and g.shape == x.shape
                    torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


def test_kernel_takes_per_channel_vectors_and_strided_modulation(device):
    """An affine LayerNorm's [C] weight / bias, and modulation rows that are views of one
    [B, T, 6, C] tensor (as the Wan block unbinds them)."""
    gen = torch.Generator().manual_seed(2)
    x, y, _, _, _ = _case(gen, 2, 3, 4, 32, 3, torch.float32, device)
    e = torch.randn(2, 3, 6, 32, generator=gen).to(device).unbind(2)
    w, bias = torch.randn(32, generator=gen).to(device), torch.randn(32, generator=gen).to(device)
    for args, kw in (((w, bias), {"y": y, "gate": e[2], "one_plus": False}), ((e[4], e[3]), {"y": y})):
        got = adaln(x, *args, **kw)
        want = adaln_torch(x, *args, **kw)
        for g, ww in zip(got, want):
            torch.testing.assert_close(g, ww, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    x = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="x must be"):
        adaln_torch(x[0], torch.zeros(8), torch.zeros(8))
    with pytest.raises(ValueError, match="scale must be"):
        adaln_torch(x, torch.zeros(1, 3, 8), torch.zeros(8))
    with pytest.raises(ValueError, match="gate given without y"):
        adaln_torch(x, torch.zeros(8), torch.zeros(8), gate=torch.zeros(8))
    with pytest.raises(ValueError, match="y must have"):
        adaln_torch(x, torch.zeros(8), torch.zeros(8), y=torch.zeros(1, 2, 3, 4))


def test_auto_runs_the_twin_on_cpu():
    gen = torch.Generator().manual_seed(3)
    x, y, gate, scale, shift = _case(gen, 1, 2, 3, 8, 2, torch.float32)
    for g, w in zip(adaln_auto(x, scale, shift, y=y, gate=gate), adaln_torch(x, scale, shift, y=y, gate=gate)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
