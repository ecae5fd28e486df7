"""Real-video-derived latents (bench/common/realvideo.py): shapes, determinism, no repeated content, real structure."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from common import realvideo  # noqa: E402

SMALL = dict(height=96, width=160)  # 12 x 20 latent positions: keeps the CPU tests fast
N_WAN, N_LTX, N_HUNYUAN = 33, 97, 121


@pytest.fixture(scope="module")
def everything():
    """Every distinct frame of every clip at stride 1: [1, 16, 251, 12, 20]."""
    return realvideo.real_latents(realvideo.available_frames(1), **SMALL)


def flat_frames(x):
    return x[0].permute(1, 0, 2, 3).flatten(1)  # [T, C*h*w]


def test_clips_decode_to_uint8_frames():
    assert realvideo.load_clip("wan").shape == (N_WAN, 480, 832, 3)
    assert realvideo.load_clip("ltx").shape == (N_LTX, 512, 768, 3)
    assert realvideo.load_clip("hunyuan").shape == (N_HUNYUAN, 480, 480, 3)
    assert realvideo.load_clip("hunyuan", drop_repeats=False).shape[0] == 152
    assert all(realvideo.load_clip(n).dtype == np.uint8 for n in realvideo.ORDER)
    with pytest.raises(ValueError, match="unknown clip"):
        realvideo.load_clip("sora")


def test_hunyuan_dropped_frames_are_near_copies():
    raw = torch.tensor(realvideo.load_clip("hunyuan", drop_repeats=False)[:, ::4, ::4]).float() / 255
    step = (raw[1:] - raw[:-1]).abs().flatten(1).mean(1)  # step[i]: frame i+1 against frame i
    repeat = (torch.arange(1, len(raw)) % 5) == 1
    assert step[repeat].max() < step[~repeat].min()  # every dropped frame changes less than any kept step


def test_available_frames():
    assert realvideo.available_frames(1) == N_WAN + N_LTX + N_HUNYUAN == 251
    assert realvideo.available_frames(4) == 9 + 25 + 31 == 65


def test_latents_like_shape_and_standardised():
    assert realvideo.latents_like(realvideo.load_clip("wan")[:3]).shape == (1, 16, 3, 60, 104)  # Wan 480x832
    x = realvideo.latents_like(realvideo.load_clip("ltx"), **SMALL)
    assert x.shape == (1, 16, N_LTX, 12, 20) and x.dtype == torch.float32
    torch.testing.assert_close(x.mean(dim=(0, 2, 3, 4)), torch.zeros(16), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3, 4), unbiased=False), torch.ones(16), atol=1e-4, rtol=0)
    assert realvideo.latents_like(realvideo.load_clip("wan")[:2], channels=4, **SMALL).shape == (1, 4, 2, 12, 20)
    with pytest.raises(ValueError, match="multiples of 8"):
        realvideo.latents_like(realvideo.load_clip("wan")[:2], height=100)


def test_cover_resize_crops_instead_of_distorting():
    rows = torch.arange(64.0).view(1, 1, 64, 1).expand(1, 3, 64, 64)  # value = row index
    for x in (rows, rows.to(torch.uint8)):
        out = realvideo._cover_resize(x, 16, 32).float()  # square -> wide: scale 0.5, keep the middle 16 rows
        assert out.shape == (1, 3, 16, 32)
        assert 14 < out.min() < 18 and 46 < out.max() < 50  # a plain resize would span the full 0..63


def test_deterministic_for_a_seed():
    frames = realvideo.load_clip("wan")[:4]
    a = realvideo.latents_like(frames, seed=3, **SMALL)
    assert torch.equal(a, realvideo.latents_like(frames, seed=3, **SMALL))
    assert not torch.allclose(a, realvideo.latents_like(frames, seed=4, **SMALL))


def test_real_latents_shapes_prefix_and_stride(everything):
    assert everything.shape == (1, 16, 251, 12, 20) and everything.dtype == torch.float32
    assert torch.equal(realvideo.real_latents(40, **SMALL), everything[:, :, :40])  # shorter = prefix
    wan = realvideo.latents_like(realvideo.load_clip("wan"), **SMALL)
    torch.testing.assert_close(everything[:, :, :N_WAN], wan)  # the Wan clip comes first
    x4 = realvideo.real_latents(5, temporal_stride=4, **SMALL)
    torch.testing.assert_close(x4, realvideo.latents_like(realvideo.load_clip("wan")[::4], **SMALL)[:, :, :5])


def test_values_standardised(everything):
    # Each clip is standardised on its own, so the whole set is too (and so is any prefix, roughly).
    torch.testing.assert_close(everything.mean(dim=(0, 2, 3, 4)), torch.zeros(16), atol=1e-4, rtol=0)
    torch.testing.assert_close(everything.std(dim=(0, 2, 3, 4), unbiased=False), torch.ones(16), atol=1e-4,
                               rtol=0)


def test_no_two_frames_identical(everything):
    v = flat_frames(everything)
    dist = torch.cdist(v, v)
    typical = dist.diagonal(1).median()
    dist.fill_diagonal_(float("inf"))
    assert dist.min() > 0.05 * typical  # not even near-identical: no repeated or looped content


def test_wan_consecutive_frames_far_more_similar_than_across_clips(everything):
    v = torch.nn.functional.normalize(flat_frames(everything), dim=1)
    cos = v @ v.T
    wan, ltx = slice(0, N_WAN), slice(N_WAN, N_WAN + N_LTX)
    hun = slice(N_WAN + N_LTX, None)
    consecutive = cos.diagonal(1)[:N_WAN - 1]
    across = torch.cat([cos[wan, ltx].flatten(), cos[wan, hun].flatten(), cos[ltx, hun].flatten()])
    assert consecutive.min() > 0.8 and across.abs().max() < 0.4
    assert consecutive.min() > across.abs().max() + 0.4


def test_too_many_frames_is_an_error():
    with pytest.raises(ValueError, match="1..65 distinct frames at temporal_stride=4"):
        realvideo.real_latents(66, temporal_stride=4, **SMALL)
    with pytest.raises(ValueError, match="1..251 distinct frames"):
        realvideo.real_latents(252, **SMALL)
    with pytest.raises(ValueError):
        realvideo.real_latents(0, **SMALL)
    with pytest.raises(ValueError, match="temporal_stride"):
        realvideo.real_latents(4, temporal_stride=0, **SMALL)
