"""FlashAttention-4's CuTe-DSL kernels (``pip install comfyui-fastar[hopper]``) for FAST-AR's two
attention shapes on Hopper: dense attention with TempCache's per-key bias (folded into the keys:
``fold_bias_into_keys``), and AnnSA's block plans (its block sparsity over the bucket-sorted history). Optional:
where ``flash_attn.cute`` does not import, or the GPU is not sm_90, ``available`` says no and the
callers keep the Triton kernel (``kernels/block_sparse_attention.py``).

Layout as the KV cache stores it, ``[B, L, H, D]``. Every call returns ``(out, lse)``, the natural
log-sum-exp ``[B, H, Lq]`` fp32, so a softmax over other keys (cuDNN's over the sink and the open
chunk) joins it (:func:`join`).
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

__all__ = ["KEY_PAD", "MIN_KEYS", "attention", "available", "fold_bias_channels", "fold_bias_into_keys", "fold_queries",
           "join", "modules", "query_fold"]


@functools.lru_cache(maxsize=None)
def modules():
    """FA4's interface module and its block-sparsity type, or None where they do not import."""
    try:
        from flash_attn.cute import interface
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as e:  # absent, or a CUDA / DSL mismatch: the Triton kernel stays
        log.info("FAST-AR: FlashAttention-4 not used (%s: %s); attention on cuDNN and the Triton kernels",
                 type(e).__name__, e)
        return None
    log.info("FAST-AR: the history's attention on FlashAttention-4")
    return interface, BlockSparseTensorsTorch


#: Keys below which FA4 is not used: it is faster than cuDNN on the history's tens of thousands of
#: keys, not on the prompt's 512 tokens (cross-attention), which stay on cuDNN.
MIN_KEYS = 4096


def available(t: torch.Tensor) -> bool:
    """Whether FA4 runs on ``t``: a CUDA tensor of fp16 / bf16 on an sm_90 GPU, with FA4 installed."""
    if not (t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)):
        return False
    if torch.cuda.get_device_capability(t.device)[0] != 9:
        return False
    return modules() is not None


#: Channels the key fold adds: the bias's head and tail (in the keys' dtype), padded to 16 (wgmma's K step).
KEY_PAD = 16
#: The logit an empty slot (bias -inf) gets in the key fold: exp of it is 0 in fp32.
_EMPTY = -1e4


def fold_bias_channels(out: torch.Tensor, key_bias: torch.Tensor, scale: float) -> None:
    """Write ``key_bias`` [..., H, L] into the key channels ``out`` [..., L, H, 2] as hi + lo = bias / scale,
    two parts in ``out``'s dtype whose sum carries twice its bits. -inf (an empty slot) becomes a logit of
    -1e4, or of half the dtype's lowest value where that is higher (fp16: -2900 at D 128): -1e4 / scale
    overflows fp16 to -inf, and hi + lo = -inf + inf is NaN."""
    empty = max(_EMPTY, 0.5 * torch.finfo(out.dtype).min * scale)
    target = (key_bias.clamp_min(empty) / scale).transpose(-1, -2)  # [..., L, H]
    head = target.to(out.dtype)
    out[..., 0] = head
    out[..., 1] = (target - head.float()).to(out.dtype)


def query_fold(batch: int, length: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[B, L, H, D + 16] zeros but for the bias channels' 1 1: queries written into its first D channels
    are folded (``fold_queries``), so a model may compute them there (the backend's ``q_rows``)."""
    qp = torch.zeros(batch, length, heads, head_dim + KEY_PAD, dtype=dtype, device=device)
    qp[..., head_dim:head_dim + 2] = 1.0
    return qp


def fold_queries(q: torch.Tensor) -> torch.Tensor:
    """q' = [q | 1 1 | 0...] [B, L, H, D + 16]: against folded keys, scale * q' . k' = scale * q . k + bias."""
    qp = query_fold(*q.shape, q.dtype, q.device)
    qp[..., :q.shape[-1]] = q
    return qp


def fold_bias_into_keys(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor,
                        window: tuple[int, int] | None = None, scale: float | None = None):
    """(q', k') [B, L, H, D + 16] with ``scale * q' . k' = scale * q . k + bias``: q' = [q | 1 1 | 0...],
    k' = [k | hi lo | 0...] (``fold_bias_channels``).

    Why: attention without a bias over them is the biased attention, its output rounded once, as a
    dense call's; the bias costs 16 more channels of q . k, where a per-score bias load slows every
    tile. ``key_bias`` [B, H, Lk] applies to keys
    ``window`` (None: all). A cache that keeps its keys folded (TempCache) spares the copy of k.
    """
    b, lk, h, d = k.shape
    scale = d ** -0.5 if scale is None else scale
    if window is not None:
        lo, hi = window
        key_bias = torch.nn.functional.pad(key_bias[..., lo:hi], (lo, lk - hi))
    kp = torch.zeros(b, lk, h, d + KEY_PAD, dtype=k.dtype, device=k.device)
    kp[..., :d] = k
    fold_bias_channels(kp[..., d:d + 2], key_bias, scale)
    return fold_queries(q), kp


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_bias: torch.Tensor | None = None,
              bias_window: tuple[int, int] | None = None, folded: torch.Tensor | None = None,
              folded_q: torch.Tensor | None = None, blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
              block_size: tuple[int, int] = (128, 128)):
    """Softmax attention of q [B, Lq, H, D] over k / v [B, Lk, H, D]: (out [B, Lq, H, D], lse [B, H, Lq]).

    ``key_bias`` [B, H, Lk] fp32: an additive logit per key on keys ``bias_window`` (TempCache's log m;
    -inf: an empty slot), folded into the keys (:func:`fold_bias_into_keys`); ``folded`` [B, Lk, H, D + 16]:
    the keys with that bias folded already (a cache's keys in ``fastar.backend.FlashAttention4``'s arena; ``k``
    and ``key_bias`` are then not read); ``folded_q`` [B, Lq, H, D + 16]: with ``folded``, q's fold made already
    (q computed into its first D channels, the backend's ``q_rows``), read in place of a fold per call. ``blocks`` =
    (counts [B, H, nqb], indices [B, H, nqb, N]) int32: query block i (``block_size[0]`` queries) reads only
    key blocks ``indices[..., i, :counts[..., i]]`` of ``block_size[1]`` keys each.
    """
    interface, sparse_tensors = modules()
    kwargs = {}
    if blocks is not None:
        counts, idx = blocks
        kwargs["block_sparse_tensors"] = sparse_tensors(
            mask_block_cnt=torch.zeros_like(counts), mask_block_idx=torch.zeros_like(idx),
            full_block_cnt=counts, full_block_idx=idx, block_size=block_size)
    scale = q.shape[-1] ** -0.5
    if folded is not None:
        q, k = fold_queries(q) if folded_q is None else folded_q, folded
    elif key_bias is not None:
        q, k = fold_bias_into_keys(q, k, key_bias, bias_window, scale)
    return tuple(interface._flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True, **kwargs)[:2])


def join(out_a, lse_a, out_b, lse_b):
    """Two softmaxes over disjoint key sets joined into one: outs [B, Lq, H, D], lses [B, H, Lq]
    (natural log; -inf: no key)."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    wa, wb = (lse_a - top).exp(), (lse_b - top).exp()
    den = (wa + wb).clamp_min(1e-30)
    wa, wb = (wa / den).transpose(1, 2)[..., None], (wb / den).transpose(1, 2)[..., None]
    return (wa * out_a.float() + wb * out_b.float()).to(out_a.dtype)
