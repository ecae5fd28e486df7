"""Dense attention on PyTorch's SDPA and cuDNN, the attention backends' shared floor (``fastar.backend``):
attention with an optional key bias, and attention with its log-sum-exp (the block-sparse call's prior).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


# On Hopper cuDNN's fused attention is the fastest SDPA backend; the others stay as fallbacks for
# shapes or masks it does not take.
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention on [B, L, H, D] tensors on PyTorch's SDPA (cuDNN first); returns [B, Lq, H, D].
    ``key_bias`` [B, H, Lk]: an additive logit bias per key (TempCache's log m), as a mask."""
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
    dense keys every query reads, for fp16 / bf16; None where cuDNN does not give what fp32 math gives on a
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
