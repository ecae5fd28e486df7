"""Attention dispatch: every self-/cross-attention call of a chunk forward lands here.

``FastARAttention`` is the attention state a forward runs under. Self-attention reads the
sink, the history and its own chunk from the KV cache (writing the chunk's own K/V into the
cache's scratch slot first, so no concatenation is ever made); cross-attention attends the
prompt tokens. Dense calls end in ``attend`` (cuDNN SDPA), or, with TempCache's log m as a key
bias on a GPU, in the block-sparse kernel (``attend_biased``); where an ``AnnConfig`` schedules
sparsity they go to AnnSA / AnnCA (``fastar.ann``). In both kernel paths the keys every query
reads unbiased (the sink, the open chunk) go to cuDNN, whose softmax the kernel starts from
(``attend_lse``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import HAS_TRITON
from ..kernels.block_sparse_attention import block_sparse_attention, dense_ranges, kernel_supports
from .errors import FastARError

# On Hopper cuDNN's fused attention is the fastest SDPA backend (bench/results/core_bench.json);
# the others stay as fallbacks for shapes or masks it does not take.
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           key_bias: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention on [B, L, H, D] tensors; returns [B, Lq, H, D].

    ``key_bias`` [B, H, Lk] is an additive logit bias per key (TempCache's log m);
    ``mask`` [Lq, Lk] is a boolean keep-mask (reference full-sequence forwards).
    """
    attn_mask = None
    if key_bias is not None:
        attn_mask = key_bias.to(q.dtype).unsqueeze(2)
    if mask is not None:
        m = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        attn_mask = m if attn_mask is None else attn_mask + m
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
                  bias_window: tuple[int, int]) -> torch.Tensor:
    """``attend`` with TempCache's key bias, which applies to keys ``[lo, hi)`` only (the history).

    On a GPU this is the block-sparse kernel on the all-keys plan: cuDNN takes the bias as a full
    mask tensor and runs ~1.5x slower than without it, while the kernel adds it per key tile and
    skips it outside the history (bench/NOTES.md, "Key splits"). Where the unbiased keys are one span
    before the history (TempCache's committed sink and the open chunk), cuDNN attends them and the
    kernel only the history, starting from that softmax; else the kernel reads all, split in two.
    """
    if not (HAS_TRITON and q.is_cuda and kernel_supports(q, 64)):
        return attend(q, k, v, key_bias=key_bias)
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


def _version(t: torch.Tensor) -> int | None:
    """A tensor's in-place write counter; None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """One side stream per device and role (the clean pass's history writes, AnnSA's prior), kept
    for the process: cuBLAS gives every stream it runs on a workspace of its own for its life."""
    if (device, role) not in _SIDE_STREAMS:
        _SIDE_STREAMS[device, role] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device, role]


def frame_visibility(num_frames: int, chunk_frames: int, sink_frames: int | None = None,
                     window_frames: int | None = None) -> torch.Tensor:
    """Which key frame each query frame sees in a chunked causal rollout: bool [F, F].

    A frame sees every frame of its own chunk and of earlier chunks; with a window it sees only
    the first ``sink_frames`` frames and the last ``window_frames`` frames before its chunk.
    """
    f = torch.arange(num_frames)
    start = f // chunk_frames * chunk_frames  # first frame of each frame's chunk
    visible = f[None, :] < start[:, None] + chunk_frames
    if window_frames is not None:
        visible &= (f[None, :] < (sink_frames or 0)) | (f[None, :] >= start[:, None] - window_frames)
    return visible


def block_causal_mask(num_frames: int, chunk_frames: int, tokens_per_frame: int,
                      sink_frames: int | None = None, window_frames: int | None = None) -> torch.Tensor:
    """Token-level mask [L, L] of a full-sequence forward that equals the cached rollout."""
    vis = frame_visibility(num_frames, chunk_frames, sink_frames, window_frames)
    return vis.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


class FastARAttention:
    """Routes a forward's attention: through the KV cache when there is one, else dense.

    ``cache`` follows the KV cache protocol (``extend`` then ``after_attention`` in every
    forward; the engine opens chunks and commits them); ``mask`` applies only without a cache.
    ``ann`` (an ``AnnConfig``, needs a cache) makes attention AnnSA / AnnCA sparse where its
    schedule says so; the engine sets ``step`` / ``num_steps`` before each forward for it.
    """

    # Its calls sync nothing with the host and keep no per-call tensors: a rollout may replay a
    # chunk of them from a CUDA graph (see ``graph_key``). Subclasses that read results on the
    # host (probes, recorders) set False.
    graph_safe = True
    # On CUDA the clean pass's history writes (TempCache's merge, AnnSA's sort) run on a side
    # stream, beside the rest of the pass; False runs them in line (to compare).
    overlap_writes = True

    def __init__(self, cache=None, mask: torch.Tensor | None = None, ann=None):
        if cache is not None and mask is not None:
            raise FastARError("FastARAttention takes a KV cache or a full-sequence mask, not both")
        self.cache = cache
        self.mask = mask
        self.ann = ann
        self.annsa = self.annca = None
        self._cross_kv = None              # (context, its version, maker, every layer's cross-attention K/V)
        self.step: int | None = None       # denoising step of the running forward (clean pass: num_steps)
        self.num_steps: int | None = None
        if ann is not None:
            if cache is None:
                raise FastARError("FastARAttention: AnnSA/AnnCA need a KV cache (ann given without one)")
            from .ann import build_ann
            self.annsa, self.annca = build_ann(ann, cache)
            self.dense_layers = set(ann.dense_layers)  # grows by calibration
            self.recall: dict[int, float] = {}         # calibration: AnnSA recall per layer

    def kv_rows(self, layer: int):
        """Where a self-attention call's K/V end up (the cache's rows of the open chunk,
        ``KVCache.scratch``), for a model to compute them there; None without a cache."""
        return self.cache.scratch(layer) if self.cache is not None else None

    def graph_key(self):
        """The cache's ``graph_key`` plus the Python-level state that routes this state's calls
        (dense layers, calibrated layers, AnnSA's written layers): equal keys, equal kernels."""
        ann = None
        if self.ann is not None:
            reps = tuple(r is None for r in self.annsa.reps) if self.annsa is not None else None
            ann = (tuple(sorted(self.dense_layers)), tuple(sorted(self.recall)), reps)
        return self.cache.graph_key(), ann

    def _sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and self.ann.sparse_at(layer, self.step, self.num_steps)

    def _calibrate(self, layer: int, q, keys, bias, plan) -> None:
        """First sparse forward over history: measure the layer's AnnSA recall; below the target
        the layer turns dense (AnnSA and AnnCA). One host read per layer, once per rollout."""
        recall = self.annsa.recall(q, keys, bias, plan).item()
        self.recall[layer] = recall
        if recall < self.ann.calibration_recall:
            self.dense_layers.add(layer)

    def self_attention(self, layer: int, q, k, v):
        if self.cache is None:
            return attend(q, k, v, mask=self.mask)
        keys, values, bias = self.cache.extend(layer, k, v)
        sparse = self.annsa is not None and self._sparse(layer)
        plan = None
        if sparse and self.ann.calibration_recall and layer not in self.recall and self.cache.frames_cached:
            plan = self.annsa.plan(layer, q)
            self._calibrate(layer, q, keys, bias, plan)
            sparse = layer not in self.dense_layers
        if sparse:
            out = self.annsa.attention(layer, q, keys, values, bias, plan)
        elif bias is not None:
            out = attend_biased(q, keys, values, bias, self.cache.bias_window())
        else:
            out = attend(q, keys, values)
        if self.cache.clean_pass:
            self._write_history(layer, q)
        else:
            self.cache.after_attention(layer, q)
        return out

    def fill_cache(self, layer: int, q, k, v) -> None:
        """The clean pass's K/V of a layer whose attention output nobody reads (the last one's:
        ``WanModel.forward(fill_cache=True)``): written, with the history writes, not attended."""
        if self.cache is None or not self.cache.clean_pass:
            raise FastARError("FastARAttention.fill_cache is for the clean pass of a cached rollout")
        self.cache.extend(layer, k, v)
        self._write_history(layer, q)

    def _write_history(self, layer: int, q) -> None:
        """The clean pass's writes of one layer's history: TempCache's merge, AnnSA's sort. Only
        the next chunk reads them, so on CUDA they run on a side stream and overlap the rest of
        the pass (layers after this one never touch this layer's cache); ``KVCache.join_writes``
        (the engine's, after the pass, and ``commit``'s) ends them."""
        index = self.annsa is not None and layer not in self.dense_layers

        def write():
            self.cache.after_attention(layer, q)
            if index:
                self.annsa.index_history(layer)

        # a side stream only where there is device work to overlap: a TempCache merge or a re-sort
        if not (self.overlap_writes and q.is_cuda and (self.cache.tempcache is not None or index)):
            return write()
        side = side_stream(q.device, "writes")
        side.wait_stream(torch.cuda.current_stream(q.device))  # the layer's K/V of this pass are ready
        q.record_stream(side)  # q is the only per-call tensor the writes read
        self.cache.write_stream = side
        with torch.cuda.stream(side):
            write()

    def cross_kv(self, context: torch.Tensor, make):
        """Every layer's cross-attention K/V for the text ``context``: ``make(context)`` once, then
        kept while the same tensor comes back unwritten to the same ``make`` (a model's bound method:
        one state may serve two models). A rollout's text conditions every forward, and remaking its
        projections cost ~0.6 ms a forward at Wan 1.3B's shapes (bench/NOTES.md). Made every time:
        an inference tensor's (it counts no writes), and inside a CUDA-graph capture a context not
        kept already (its tensors would live in the graph's memory pool)."""
        version = _version(context)
        memo = self._cross_kv
        if version is not None and memo is not None and memo[0] is context and memo[1:3] == (version, make):
            return memo[3]
        kv = make(context)
        if not (context.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._cross_kv = (context, version, make, kv)
        return kv

    def cross_attention(self, layer: int, q, k, v):
        if self.annca is not None and self._sparse(layer):
            return self.annca.attention(layer, q, k, v)
        return attend(q, k, v)
