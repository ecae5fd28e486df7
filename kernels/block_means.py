"""Mean of the filled keys of each block of history keys, as one Triton kernel.

Why: AnnSA's 'quant' planner represents every block of ``block`` sorted history keys by the
mean of its filled keys, once per clean-pass write of a layer. In eager PyTorch that is a
zero-filled copy of the layer's history, a masked fill and a block sum: four passes over
~86 MB a layer at the Wan 1.3B TempCache budget. Here each program reads one block of one
head once and writes its mean and count.

Semantics (the twin defines them): keys ``k [B, M, H, D]`` (the cache's layout, any strides),
``filled [B, H, M]`` bool. Key block ``j`` of head ``(b, h)`` is rows ``[j * block, (j + 1) *
block)`` (the last may be shorter); its count is the number of filled rows and its mean the
fp32 sum of their keys over that count (zeros for a block with no filled key). Returns
``(mean [B, H, nkb, D] fp32, count [B, H, nkb] fp32)`` with ``nkb = ceil(M / block)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, power_of_two, triton_runs_on

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["block_means", "block_means_auto", "block_means_torch"]


def _check(k: Tensor, filled: Tensor, block: int) -> tuple[int, int, int, int, int]:
    if k.ndim != 4:
        raise ValueError(f"k must be [B, M, H, D], got {tuple(k.shape)}")
    b, m, h, d = k.shape
    if filled.dtype != torch.bool or tuple(filled.shape) != (b, h, m):
        raise ValueError(f"filled must be bool [B, H, M] = [{b}, {h}, {m}], got {filled.dtype} {tuple(filled.shape)}")
    if filled.device != k.device:
        raise ValueError(f"device mismatch: k on {k.device}, filled on {filled.device}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return b, m, h, d, -(-m // block)


def block_means_torch(k: Tensor, filled: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Reference twin: the filled keys in k's dtype, zero-padded to whole blocks, summed in fp32."""
    b, m, h, d, nkb = _check(k, filled, block)
    pad = nkb * block - m
    count = torch.nn.functional.pad(filled.float(), (0, pad)).view(b, h, nkb, block).sum(-1)
    kb = k.new_zeros(b, h, nkb * block, d)
    kb[:, :, :m] = k.transpose(1, 2).masked_fill(~filled[..., None], 0)
    mean = kb.view(b, h, nkb, block, d).sum(-2, dtype=torch.float32) / count.clamp_min(1)[..., None]
    return mean, count


if HAS_TRITON:

    @triton.jit(do_not_specialize=["H", "M"])
    def _block_means_kernel(k_ptr, filled_ptr, mean_ptr, count_ptr, H, M,
                            stride_kb, stride_km, stride_kh, stride_kd,
                            BLOCK: tl.constexpr, D: tl.constexpr):
        """One program: key block ``program_id(0)`` of head ``program_id(1)`` (= b * H + h)."""
        j = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = j * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        inside = rows < M
        full = tl.load(filled_ptr + bh.to(tl.int64) * M + rows, mask=inside, other=0) != 0
        ptrs = k_ptr + b * stride_kb + h * stride_kh + rows.to(tl.int64)[:, None] * stride_km + offs_d[None, :] * stride_kd
        keys = tl.load(ptrs, mask=full[:, None], other=0.0).to(tl.float32)
        count = tl.sum(full.to(tl.float32), 0)
        mean = tl.sum(keys, 0) / tl.maximum(count, 1.0)
        nkb = tl.num_programs(0)
        out = (bh.to(tl.int64) * nkb + j) * D
        tl.store(mean_ptr + out + offs_d, mean)
        tl.store(count_ptr + bh.to(tl.int64) * nkb + j, count)


def block_means(k: Tensor, filled: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract (``block`` and D powers of two); grid ``(nkb, B * H)``."""
    if not HAS_TRITON:
        raise RuntimeError("block_means needs triton, which is not importable")
    b, m, h, d, nkb = _check(k, filled, block)
    if not (power_of_two(block) and power_of_two(d)):
        raise ValueError(f"kernel needs block and D powers of two, got block={block}, D={d}")
    check_triton_runs_on(k)
    mean = torch.empty(b, h, nkb, d, dtype=torch.float32, device=k.device)
    count = torch.empty(b, h, nkb, dtype=torch.float32, device=k.device)
    if mean.numel() == 0:
        return mean, count.zero_()
    _block_means_kernel[(nkb, b * h)](k, filled.contiguous().view(torch.uint8), mean, count, h, m, *k.stride(),
                                      BLOCK=block, D=d, num_warps=4)
    return mean, count


def block_means_auto(k: Tensor, filled: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """The kernel where Triton runs and block and D are powers of two, else the twin."""
    d = k.shape[-1] if k.ndim == 4 else 0
    fits = isinstance(block, int) and power_of_two(block) and power_of_two(d)
    fn = block_means if triton_runs_on(k) and fits else block_means_torch
    return fn(k, filled, block)
