"""Dense attention primitives on PyTorch's SDPA and cuDNN, or FlashAttention-4 where installed on
Hopper (``kernels/flash4.py``), shared by ``FastARAttention`` and AnnSA: plain attention, attention
with its log-sum-exp (the block-sparse kernel's prior), attention with TempCache's key bias, and the
side streams the clean pass's writes use.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import flash4, use_kernel
from ..kernels.block_sparse_attention import block_sparse_attention, kernel_supports
from ..kernels.plan import dense_ranges

# On Hopper cuDNN's fused attention is the fastest SDPA backend (bench/results/core_bench.json);
# the others stay as fallbacks for shapes or masks it does not take.
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention on [B, L, H, D] tensors; returns [B, Lq, H, D].

    ``key_bias`` [B, H, Lk] is an additive logit bias per key (TempCache's log m).
    On Hopper with FlashAttention-4 installed, calls over many keys run there: faster than cuDNN on
    the history's shapes (``kernels/flash4.py``).
    """
    if flash4.runs(q, k):
        return flash4.attention(q, k, v, key_bias=key_bias)[0]
    return attend_sdpa(q, k, v, key_bias=key_bias)


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``attend`` on PyTorch's SDPA (cuDNN first)."""
    attn_mask = None if key_bias is None else key_bias.to(q.dtype).unsqueeze(2)
    with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attn_mask)
    return out.transpose(1, 2)


_CUDNN_LSE: dict = {}


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Softmax attention of [B, L, H, D] tensors with its log-sum-exp, as the block-sparse kernel's
    ``prior``: (out [B, H, Lq, D], lse [B, H, Lq] fp32, natural log), or None where it cannot be had.

    On CUDA, cuDNN's fused attention (it returns the log-sum-exp), faster than the kernel on the
    dense keys every query reads (bench/NOTES.md, "The sink and the open chunk on cuDNN, as the
    kernel's prior"), for fp16 / bf16; None where cuDNN does not give what fp32 math gives on a
    small case (checked once per device, dtype and head dim, outside any CUDA-graph capture:
    called directly, the op accepts inputs it computes wrongly, fp32 among them). Off CUDA fp32
    math, for the kernel under Triton's interpreter (small shapes).
    """
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if not q.is_cuda:
        return _attend_lse_math(qt, kt, vt)
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _CUDNN_LSE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CUDNN_LSE[key] = q.dtype in (torch.float16, torch.bfloat16) and _cudnn_lse_agrees(*key)
    if not _CUDNN_LSE[key]:
        return None
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True)[:2]
    return out, lse.reshape(lse.shape[:3])


def _attend_lse_math(qt, kt, vt):
    logits = qt.float() @ kt.float().transpose(-1, -2) / math.sqrt(qt.shape[-1])
    return (logits.softmax(-1) @ vt.float()).to(qt.dtype), logits.logsumexp(-1)


def _cudnn_lse_agrees(device, dtype, head_dim: int) -> bool:
    """Whether cuDNN's attention and log-sum-exp match fp32 math on a small random case."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, head_dim, device=device, generator=g).to(dtype) for n in (80, 200, 200))
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # TypeError: an older torch's signature
        return False
    want, want_lse = _attend_lse_math(q, k, v)
    lse = lse.reshape(want_lse.shape).float()
    return bool(((out.float() - want.float()).norm() <= 1e-2 * want.float().norm()) &
                ((lse - want_lse).abs().max() <= 1e-2 * want_lse.abs().max().clamp_min(1.0)))


_DENSE_PLANS: dict = {}


def attend_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor,
                  bias_window: tuple[int, int], folded: torch.Tensor | None = None,
                  folded_q: torch.Tensor | None = None) -> torch.Tensor:
    """``attend`` with TempCache's key bias, which applies to keys ``[lo, hi)`` only (the history).

    With FlashAttention-4 (Hopper): one call over all keys, the bias folded into the keys (``folded``,
    the cache's own fold, ``KVCache.folded_keys``, with q's where the model made it there, ``folded_q``;
    else ``flash4.fold_bias_into_keys``). Else on a GPU: the block-sparse kernel (``attend_biased_kernel``).
    """
    if flash4.runs(q, k):
        return flash4.attention(q, k, v, key_bias=key_bias, bias_window=bias_window, folded=folded,
                                folded_q=folded_q)[0]
    if not use_kernel(q, kernel_supports(q, 64), interpreted=False):
        return attend(q, k, v, key_bias=key_bias)
    return attend_biased_kernel(q, k, v, key_bias, bias_window)


def attend_biased_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor,
                         bias_window: tuple[int, int]) -> torch.Tensor:
    """``attend_biased`` on the block-sparse kernel's all-keys plan: cuDNN takes the bias as a full
    mask tensor and runs ~1.5x slower than without it, while the kernel adds it per key tile and
    skips it outside the history (bench/NOTES.md, "Key splits"). Where the unbiased keys are one span
    before the history (TempCache's committed sink and the open chunk), cuDNN attends them and the
    kernel only the history, starting from that softmax; else the kernel reads all, split in two.
    """
    B, Lq, H, _ = q.shape
    lo, hi = bias_window
    prior = attend_lse(q, k[:, :lo], v[:, :lo]) if 0 < lo and hi == k.shape[1] else None
    first = lo if prior is not None else 0
    shape = (B, H, Lq, first, k.shape[1], q.device)
    if shape not in _DENSE_PLANS:  # one per shape: a rollout at its budget meets one or two
        ranges, counts = dense_ranges(B, H, Lq, k.shape[1] - first, 64, device=q.device)
        _DENSE_PLANS[shape] = (ranges + first, counts)
    out = block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *_DENSE_PLANS[shape],
                                 key_bias=key_bias, bias_window=bias_window, prior=prior,
                                 num_splits=None if prior is not None else 2)
    return out.transpose(1, 2)


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """One side stream per device and role (the clean pass's history writes, AnnSA's prior), kept
    for the process: cuBLAS gives every stream it runs on a workspace of its own for its life."""
    if (device, role) not in _SIDE_STREAMS:
        _SIDE_STREAMS[device, role] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device, role]
