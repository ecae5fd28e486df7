"""Top-1 nearest cached key (TempCache's temporal correspondence), as a Triton kernel.

One kernel per file, beside its torch twin with the same signature: the twin is the
oracle the kernel is tested against and the fallback wherever Triton cannot run (CPU).

For every new token ``x[g, n]`` we want the cached key ``keys[g, j]`` (``j < key_len``)
with the largest dot product, so a KV-cache merge can pair each new token with its
temporal counterpart. Scores are accumulated in fp32 whatever the input dtype; ties go
to the smallest index in both implementations, so kernel and twin agree exactly on
integer-valued (exactly representable) data and are deterministic on any data.

Neither implementation builds the full ``[G, N, M]`` score matrix: the cache can hold
hundreds of thousands of keys, so both stream key blocks while keeping a running
max / argmax.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import HAS_TRITON, triton_runs_on

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "HAS_TRITON",
    "top1_correspondence",
    "top1_correspondence_torch",
    "top1_correspondence_triton",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(x: Tensor, keys: Tensor, key_len, key_scale=None) -> tuple[int, int, int, int]:
    """Validate shapes up front so a bad call fails with a clear message, not deep in a matmul.

    Returns ``(G, N, D, key_len)`` with ``key_len`` resolved to an int in ``[0, M]``.
    """
    if not isinstance(x, Tensor) or not isinstance(keys, Tensor):
        raise ValueError("x and keys must be torch tensors")
    if x.ndim != 3:
        raise ValueError(f"x must be 3-D [G, N, D], got ndim={x.ndim} shape={tuple(x.shape)}")
    if keys.ndim != 3:
        raise ValueError(
            f"keys must be 3-D [G, M, D], got ndim={keys.ndim} shape={tuple(keys.shape)}"
        )
    G, N, D = x.shape
    Gk, M, Dk = keys.shape
    if Gk != G:
        raise ValueError(f"group count G mismatch: x has G={G}, keys has G={Gk}")
    if Dk != D:
        raise ValueError(f"head dim D mismatch: x has D={D}, keys has D={Dk}")
    if not x.is_floating_point() or not keys.is_floating_point():
        raise ValueError(f"x and keys must be floating point, got dtype {x.dtype} and {keys.dtype}")
    if x.device != keys.device:
        raise ValueError(f"device mismatch: x on {x.device}, keys on {keys.device}")
    if key_len is None:
        key_len = M
    else:
        try:
            key_len = operator.index(key_len)
        except TypeError:
            kind = type(key_len).__name__
            raise ValueError(f"key_len must be an int or None, got {kind}") from None
    if not 0 <= key_len <= M:
        raise ValueError(f"key_len={key_len} out of range [0, M={M}]")
    if key_scale is not None and (tuple(key_scale.shape) != (G, M) or key_scale.dtype != torch.float32
                                  or key_scale.device != keys.device):
        raise ValueError(f"key_scale must be float32 [G={G}, M={M}] on {keys.device}, "
                         f"got {key_scale.dtype} {tuple(key_scale.shape)} on {key_scale.device}")
    return G, N, D, key_len


def _empty_result(G: int, N: int, device) -> tuple[Tensor, Tensor]:
    """Result for "no valid key": index -1 and score -inf, so callers can test for it."""
    index = torch.full((G, N), -1, dtype=torch.int64, device=device)
    score = torch.full((G, N), float("-inf"), dtype=torch.float32, device=device)
    return index, score


def top1_correspondence_torch(
    x: Tensor, keys: Tensor, key_len: int | None = None, key_scale: Tensor | None = None,
    block_keys: int = 1024
) -> tuple[Tensor, Tensor]:
    """Reference twin: best key index (int64 [G, N]) and its fp32 score (float32 [G, N]).

    ``key_scale`` (float32 [G, M]) multiplies each key's scores: with 1/|k| the argmax is
    the most cosine-similar key (TempCache's matching) without a normalised copy of the cache.

    Streams ``block_keys`` keys at a time so peak memory is ``G * N * block_keys`` scores,
    not ``G * N * M``. Within a block the smallest index among equal maxima is taken;
    across blocks the running best changes only on a strictly greater score, so the
    earliest index wins ties, matching the kernel.
    """
    G, N, D, key_len = _check_inputs(x, keys, key_len, key_scale)
    block_keys = operator.index(block_keys)
    if block_keys < 1:
        raise ValueError(f"block_keys must be >= 1, got {block_keys}")
    best_idx, best = _empty_result(G, N, x.device)
    if key_len == 0 or G == 0 or N == 0:
        return best_idx, best

    xf = x.float()
    for start in range(0, key_len, block_keys):
        stop = min(start + block_keys, key_len)
        kb = keys[:, start:stop].float()  # upcast one block only, never the whole cache
        s = torch.bmm(xf, kb.transpose(1, 2))  # [G, N, b], fp32 accumulation
        if key_scale is not None:
            s = s * key_scale[:, None, start:stop]
        bmax = s.amax(dim=-1)
        # torch.max(dim) does not promise which index it returns on ties; pick the smallest.
        cols = torch.arange(start, stop, device=x.device, dtype=torch.int64)
        hit = s == bmax.unsqueeze(-1)
        bidx = torch.where(hit, cols, torch.iinfo(torch.int64).max).amin(dim=-1)
        upd = bmax > best
        best = torch.where(upd, bmax, best)
        best_idx = torch.where(upd, bidx, best_idx)
    return best_idx, best


if HAS_TRITON:

    @triton.jit
    def _top1_correspondence_kernel(
        x_ptr,
        k_ptr,
        scale_ptr,
        idx_ptr,
        score_ptr,
        N,
        key_len,
        stride_xg,
        stride_xn,
        stride_xd,
        stride_kg,
        stride_km,
        stride_kd,
        stride_sg,
        stride_og,
        stride_on,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        UPCAST: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        HAS_SCALE: tl.constexpr,
    ):
        """One program: BLOCK_N queries of one group against all valid keys of that group."""
        g = tl.program_id(0).to(tl.int64)  # int64 so g * stride never overflows on big caches
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        n_mask = offs_n < N

        x_ptrs = x_ptr + g * stride_xg + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd
        xb = tl.load(x_ptrs, mask=n_mask[:, None], other=0.0)
        if UPCAST:
            xb = xb.to(tl.float32)

        best = tl.full([BLOCK_N], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK_N], -1, tl.int32)
        k_base = k_ptr + g * stride_kg
        for start in range(0, key_len, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < key_len
            k_ptrs = k_base + offs_m[:, None] * stride_km + offs_d[None, :] * stride_kd
            kb = tl.load(k_ptrs, mask=m_mask[:, None], other=0.0)
            if UPCAST:
                kb = kb.to(tl.float32)
            s = tl.dot(xb, tl.trans(kb), input_precision=INPUT_PRECISION)  # fp32 accumulator
            if HAS_SCALE:
                s = s * tl.load(scale_ptr + g * stride_sg + offs_m, mask=m_mask, other=0.0)[None, :]
            s = tl.where(m_mask[None, :], s, float("-inf"))
            # Every block holds at least one valid key (start < key_len), so bmax is finite
            # and the masked -inf lanes can never equal it.
            bmax = tl.max(s, axis=1)
            cand = tl.where(s == bmax[:, None], offs_m[None, :], 2147483647)
            bidx = tl.min(cand, axis=1)
            upd = bmax > best  # strict: an earlier block keeps ties
            best = tl.where(upd, bmax, best)
            best_idx = tl.where(upd, bidx, best_idx)

        out_off = g * stride_og + offs_n * stride_on
        tl.store(idx_ptr + out_off, best_idx.to(tl.int64), mask=n_mask)
        tl.store(score_ptr + out_off, best, mask=n_mask)


def top1_correspondence_triton(
    x: Tensor,
    keys: Tensor,
    key_len: int | None = None,
    key_scale: Tensor | None = None,
    *,
    block_n: int = 64,
    block_m: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton kernel with the twin's contract; grid is (G, ceil(N / block_n)).

    Strides are passed explicitly, so strided views (``keys[:, :L]`` of a preallocated
    cache, a permuted ``[M, H, D]`` buffer) are read in place: the cache is never copied.
    No autotuning, so the launch is the same under ``TRITON_INTERPRET=1``; block sizes
    and warps are keyword arguments instead (64/64/4 was the fastest of those tried on an
    H200 for bf16, D=128). fp32 inputs take an IEEE (non-TF32) dot to match the twin,
    which is slower than cuBLAS there: keep caches in bf16/fp16 for speed.
    """
    if not HAS_TRITON:
        raise RuntimeError("top1_correspondence_triton needs triton, which is not importable")
    G, N, D, key_len = _check_inputs(x, keys, key_len, key_scale)
    for name, v in (("x", x), ("keys", keys)):
        if v.dtype not in _KERNEL_DTYPES:
            raise ValueError(f"{name} dtype {v.dtype} unsupported by the kernel (fp32/bf16/fp16)")
    if D < 16 or D & (D - 1):
        raise ValueError(f"kernel needs D a power of two >= 16, got D={D}")
    for name, b in (("block_n", block_n), ("block_m", block_m)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot minimum), got {b}")

    index, score = _empty_result(G, N, x.device)
    if key_len == 0 or G == 0 or N == 0:
        return index, score

    # tl.dot needs equal operand dtypes; an fp32 dot of upcast operands is lossless. Also
    # upcast bf16 off-GPU: Triton's interpreter (3.x) multiplies bf16 operands as their raw
    # uint16 bits. bf16 products are exact in fp32, so the result is the same either way.
    upcast = x.dtype != keys.dtype or (x.dtype == torch.bfloat16 and not x.is_cuda)
    fp32_dot = upcast or x.dtype == torch.float32
    # "ieee" keeps fp32 inputs out of TF32, so the kernel matches the fp32 twin.
    precision = "ieee" if fp32_dot else None
    launch = {"num_warps": num_warps}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    grid = (G, triton.cdiv(N, block_n))
    _top1_correspondence_kernel[grid](
        x,
        keys,
        keys if key_scale is None else key_scale,
        index,
        score,
        N,
        key_len,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        0 if key_scale is None else key_scale.stride(0),
        index.stride(0),
        index.stride(1),
        D=D,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        UPCAST=upcast,
        INPUT_PRECISION=precision,
        HAS_SCALE=key_scale is not None,
        **launch,
    )
    return index, score


def top1_correspondence(
    x: Tensor, keys: Tensor, key_len: int | None = None, key_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Dispatch: the kernel where Triton can run, else the torch twin (same results)."""
    if triton_runs_on(x) and x.dtype in _KERNEL_DTYPES and keys.dtype in _KERNEL_DTYPES:
        D = x.shape[-1] if x.ndim == 3 else 0
        if D >= 16 and not D & (D - 1):
            return top1_correspondence_triton(x, keys, key_len, key_scale)
    return top1_correspondence_torch(x, keys, key_len, key_scale)
