"""Real-video-derived latents for tests and benchmarks, from clips committed in ``bench/data``.

Why: cache compression (TempCache) and approximate nearest-neighbour attention (AnnCA/AnnSA) are only
measured honestly on inputs with real video structure; i.i.d. random latents have no temporal or spatial
redundancy and make every compression look either useless or free. No Wan VAE or weights exist here and the
GPU machine is offline, so the inputs come from real generated clips stored beside this file (see
``bench/data/LICENSE.md``) and a fixed linear stand-in for the VAE encoder (``latents_like``).

    from common.realvideo import load_clip, latents_like, real_latents   # with bench/ on sys.path
    x = real_latents(21, temporal_stride=4)   # [1, 16, 21, 60, 104] float32
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageSequence

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # bench/data

# name -> (file, (period, phase) of frames that repeat their predecessor, or None).
# The Hunyuan clip was apparently frame-rate converted: every 5th frame (index = 1 mod 5) is a near-copy of the one
# before it (mean |diff| ~4x below the other steps); such copies would fake temporal redundancy, so they go.
CLIPS = {
    "wan": ("text_to_video_wan-1.webp", None),  # Wan 2.1 T2V 1.3B, 832x480, 33 frames
    "ltx": ("ltxv_image_to_video-1.webp", None),  # LTX-Video 2B i2v, 768x512, 97 frames
    "hunyuan": ("video_hunyuan_video_1.5_720p_i2v-1.webp", (5, 1)),  # HunyuanVideo 1.5, 480x480, 152 -> 121
}
ORDER = ("wan", "ltx", "hunyuan")  # real_latents fills frames in this order: the Wan clip first


@functools.lru_cache(maxsize=None)
def _decode(name: str, drop_repeats: bool) -> np.ndarray:
    if name not in CLIPS:
        raise ValueError(f"unknown clip {name!r}; choose one of {sorted(CLIPS)}")
    file, repeats = CLIPS[name]
    with Image.open(os.path.join(DATA, file)) as im:
        frames = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])
    if drop_repeats and repeats is not None:
        period, phase = repeats
        frames = frames[np.arange(len(frames)) % period != phase]
    frames.setflags(write=False)  # cached and shared between callers
    return frames


def load_clip(name: str, drop_repeats: bool = True) -> np.ndarray:
    """Decoded frames of a stored clip, uint8 [T, H, W, 3] (read-only; decoded once per process).

    ``drop_repeats`` removes the frame-rate-conversion near-copies listed in ``CLIPS`` so that no two frames
    are (near) identical; pass False to get every stored frame.
    """
    return _decode(name, drop_repeats)


def _orthogonal(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A fixed random [rows, cols] matrix with orthonormal columns: same seed, same matrix, on any machine."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # sign fix makes QR's output unique


def _cover_resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[T, 3, h, w] -> [T, 3, height, width]: scale to cover the target (aspect kept), then center-crop.

    Works on uint8 too (antialiased bilinear; rounding adds < 1/2 level, below the clips' own coding noise).
    """
    h, w = x.shape[-2:]
    scale = max(height / h, width / w)
    nh, nw = max(height, math.ceil(h * scale - 1e-6)), max(width, math.ceil(w * scale - 1e-6))
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
    top, left = (nh - height) // 2, (nw - width) // 2
    return x[..., top:top + height, left:left + width]


def latents_like(frames: np.ndarray, height: int = 480, width: int = 832, channels: int = 16,
                 seed: int = 0) -> torch.Tensor:
    """A fixed stand-in for the Wan VAE encoder: uint8 [T, H, W, 3] -> float32 [1, channels, T, height/8, width/8].

    Each frame is cover-resized and center-cropped to height x width (no distortion), pixel-unshuffled 8x8
    (192 values per latent position), projected to ``channels`` by a seeded random orthogonal matrix, and
    standardised per channel over the whole clip (Wan latents are roughly normalised).
    Being linear and local, it keeps the clip's spatial and temporal correlation structure, which is what
    cache-compression and nearest-neighbour measurements depend on. It is NOT the real VAE: no temporal
    compression (one latent frame per input frame) and no learned features.
    """
    if height % 8 or width % 8:
        raise ValueError(f"height and width must be multiples of 8, got {height}x{width}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got {tuple(frames.shape)}")
    proj = _orthogonal(192, channels, seed)  # [192, C]
    out = torch.empty(channels, len(frames), height // 8, width // 8)
    for s in range(0, len(frames), 16):  # batches bound the memory of the full-resolution float copy
        x = _cover_resize(torch.tensor(frames[s:s + 16]).permute(0, 3, 1, 2), height, width)  # uint8: fast
        x = F.pixel_unshuffle(x.float() / 127.5 - 1, 8)  # [t, 192, height/8, width/8]
        out[:, s:s + len(x)] = torch.einsum("tphw,pc->cthw", x, proj)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    std = out.std(dim=(1, 2, 3), keepdim=True, unbiased=False).clamp_min(1e-6)
    return ((out - mean) / std).unsqueeze(0)


@functools.lru_cache(maxsize=None)
def _clip_length(name: str) -> int:
    """Frames ``load_clip(name)`` returns, read from the file header without decoding."""
    file, repeats = CLIPS[name]
    with Image.open(os.path.join(DATA, file)) as im:
        n = im.n_frames
    return n if repeats is None else sum(1 for i in range(n) if i % repeats[0] != repeats[1])


def available_frames(temporal_stride: int = 1) -> int:
    """How many latent frames ``real_latents`` can give at this stride without repeating any content."""
    return sum(len(range(0, _clip_length(n), temporal_stride)) for n in ORDER)


@functools.lru_cache(maxsize=8)
def _clip_latents(name: str, height: int, width: int, temporal_stride: int, seed: int) -> torch.Tensor:
    return latents_like(load_clip(name)[::temporal_stride], height, width, 16, seed)


def real_latents(num_frames: int, height: int = 480, width: int = 832, temporal_stride: int = 1,
                 seed: int = 0) -> torch.Tensor:
    """``num_frames`` latent-like frames from the real clips, float32 [1, 16, num_frames, height/8, width/8].

    The Wan clip comes first, then the LTX and Hunyuan clips (cover-resized to the same size) as needed; no
    frame is repeated or looped, so asking for more than the clips hold raises ValueError. ``temporal_stride``
    keeps every k-th video frame of each clip (4 mimics the spacing of Wan's 4x temporal VAE compression).
    Each clip is standardised as a whole before truncation, so a shorter request is a prefix of a longer one;
    the same projection (``seed``) is used for every clip, as one encoder would be.
    """
    if temporal_stride < 1:
        raise ValueError(f"temporal_stride must be >= 1, got {temporal_stride}")
    have = available_frames(temporal_stride)
    if not 1 <= num_frames <= have:
        raise ValueError(f"asked for {num_frames} latent frames, but the stored clips ({', '.join(ORDER)}) give "
                         f"1..{have} distinct frames at temporal_stride={temporal_stride}; no frame is repeated")
    parts, left = [], num_frames
    for name in ORDER:
        if left == 0:
            break
        lat = _clip_latents(name, height, width, temporal_stride, seed)[:, :, :left]
        parts.append(lat)
        left -= lat.shape[2]
    return torch.cat(parts, dim=2).clone()  # a copy: callers may modify it without touching the cache


if __name__ == "__main__":
    for n in ORDER:
        f = load_clip(n)
        print(f"{n}: {tuple(f.shape)}  (stored frames: {len(load_clip(n, drop_repeats=False))})")
    for k in (1, 4):
        print(f"available latent frames at temporal_stride={k}: {available_frames(k)}")
