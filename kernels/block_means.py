"""Mean of the filled keys of each block of history keys, as one Triton kernel.

Why: AnnSA's 'quant' planner represents each block of sorted history keys by its filled keys'
mean, at every clean-pass write of a layer; eager PyTorch needs a zero-filled copy of the whole
history, a masked fill and a block sum, where one read of each block suffices.

Semantics (the twin defines them): keys ``k [B, M, H, D]`` (the cache's layout, any strides),
``filled [B, H, M]`` bool, or None when every row is filled. Key block ``j`` of head ``(b, h)`` is
rows ``[j * block, (j + 1) * block)`` (the last may be shorter); its count is its filled rows, its
mean their keys' fp32 sum over that count (zeros for a block with none). Returns ``(mean [B, H,
nkb, D], count [B, H, nkb])``, fp32, ``nkb = ceil(M / block)``, written into ``out`` (two fp32
tensors of those shapes, any strides, e.g. slices of a larger buffer) when given.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["block_means", "block_means_auto", "block_means_torch"]


def _check(k: Tensor, filled: Tensor | None, block: int, out) -> tuple[int, int, int, int, int]:
    if k.ndim != 4:
        raise ValueError(f"k must be [B, M, H, D], got {tuple(k.shape)}")
    b, m, h, d = k.shape
    if filled is not None:
        if filled.dtype != torch.bool or tuple(filled.shape) != (b, h, m):
            raise ValueError(f"filled must be bool [B, H, M] = [{b}, {h}, {m}] or None, got {filled.dtype} "
                             f"{tuple(filled.shape)}")
        if filled.device != k.device:
            raise ValueError(f"device mismatch: k on {k.device}, filled on {filled.device}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    nkb = -(-m // block)
    if out is not None:
        mean, count = out
        if tuple(mean.shape) != (b, h, nkb, d) or tuple(count.shape) != (b, h, nkb) or \
                mean.dtype != torch.float32 or count.dtype != torch.float32 or \
                mean.device != k.device or count.device != k.device:
            raise ValueError(f"out must be fp32 tensors [B, H, nkb, D] = [{b}, {h}, {nkb}, {d}] and [{b}, {h}, {nkb}] "
                             f"on {k.device}, got {mean.dtype} {tuple(mean.shape)} and {count.dtype} "
                             f"{tuple(count.shape)}")
    return b, m, h, d, nkb


def _out(out, mean: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    if out is None:
        return mean, count
    out[0].copy_(mean)
    out[1].copy_(count)
    return out


def block_means_torch(k: Tensor, filled: Tensor | None, block: int, out=None) -> tuple[Tensor, Tensor]:
    """Reference twin: the filled keys in k's dtype, zero-padded to whole blocks, summed in fp32."""
    b, m, h, d, nkb = _check(k, filled, block, out)
    if filled is None:
        filled = torch.ones(b, h, m, dtype=torch.bool, device=k.device)
    pad = nkb * block - m
    count = torch.nn.functional.pad(filled.float(), (0, pad)).view(b, h, nkb, block).sum(-1)
    kb = k.new_zeros(b, h, nkb * block, d)
    kb[:, :, :m] = k.transpose(1, 2).masked_fill(~filled[..., None], 0)
    mean = kb.view(b, h, nkb, block, d).sum(-2, dtype=torch.float32) / count.clamp_min(1)[..., None]
    return _out(out, mean, count)


if HAS_TRITON:

    # Not specialised on: the counts' strides follow the block count, which grows with an unbounded
    # history, and each new divisibility by 16 would recompile mid-rollout.
    @triton.jit(do_not_specialize=["H", "M", "stride_cb", "stride_ch"])
    def _block_means_kernel(k_ptr, filled_ptr, mean_ptr, count_ptr, H, M,
                            stride_kb, stride_km, stride_kh, stride_kd, stride_mb, stride_mh, stride_mj, stride_md,
                            stride_cb, stride_ch, stride_cj, BLOCK: tl.constexpr, D: tl.constexpr,
                            ALL_FILLED: tl.constexpr):
        """One program: key block ``program_id(0)`` of head ``program_id(1)`` (= b * H + h)."""
        j = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = j * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        inside = rows < M
        if ALL_FILLED:
            full = inside
        else:
            full = tl.load(filled_ptr + bh.to(tl.int64) * M + rows, mask=inside, other=0) != 0
        ptrs = k_ptr + b * stride_kb + h * stride_kh + rows.to(tl.int64)[:, None] * stride_km + offs_d[None, :] * stride_kd
        keys = tl.load(ptrs, mask=full[:, None], other=0.0).to(tl.float32)
        count = tl.sum(full.to(tl.float32), 0)
        mean = tl.sum(keys, 0) / tl.maximum(count, 1.0)
        tl.store(mean_ptr + b * stride_mb + h * stride_mh + j * stride_mj + offs_d * stride_md, mean)
        tl.store(count_ptr + b * stride_cb + h * stride_ch + j * stride_cj, count)


def block_means(k: Tensor, filled: Tensor | None, block: int, out=None) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract (``block`` and D powers of two); grid ``(nkb, B * H)``."""
    if not HAS_TRITON:
        raise RuntimeError("block_means needs triton, which is not importable")
    b, m, h, d, nkb = _check(k, filled, block, out)
    if not (power_of_two(block) and power_of_two(d)):
        raise ValueError(f"kernel needs block and D powers of two, got block={block}, D={d}")
    check_triton_runs_on(k)
    mean, count = out if out is not None else (torch.empty(b, h, nkb, d, dtype=torch.float32, device=k.device),
                                                torch.empty(b, h, nkb, dtype=torch.float32, device=k.device))
    if mean.numel() == 0:
        return mean, count.zero_()
    # unread without a mask: any tensor stands in
    mask = filled.contiguous().view(torch.uint8) if filled is not None else count
    _block_means_kernel[(nkb, b * h)](k, mask, mean, count, h, m, *k.stride(), *mean.stride(), *count.stride(),
                                      BLOCK=block, D=d, ALL_FILLED=filled is None, num_warps=4)
    return mean, count


def block_means_auto(k: Tensor, filled: Tensor | None, block: int, out=None) -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs and block and D are powers of two, else the twin."""
    d = k.shape[-1] if k.ndim == 4 else 0
    fits = isinstance(block, int) and power_of_two(block) and power_of_two(d)
    fn = block_means if use_kernel(k, fits) else block_means_torch
    return fn(k, filled, block, out)
