"""The attention backend a rollout runs on, chosen once (:func:`choose`): ``Torch`` (SDPA, the kernels'
torch twins), ``Triton`` (the block-sparse kernel for TempCache's biased calls and AnnSA's plans, cuDNN for
the keys every query reads) or ``FlashAttention4`` (Hopper, where ``flash_attn.cute`` imports: both calls
on FA4, TempCache's bias folded into its keys).

A backend owns every attention call of a rollout (dense, biased, block-sparse and the prior softmax the
block-sparse call starts from), the side streams beside them, and the storage of the keys and queries it
reads. FA4 reads keys with their bias folded into 16 more channels, so a cache's keys live in the
backend's arena (``new_keys``) and the cache says where their bias changed (``bias_written``): the cache
protocol stays K, V, key bias and layout, and the cache imports no kernel.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ..kernels import flash4, triton_runs_on, use_kernel
from ..kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_auto, kernel_supports
from ..kernels.plan import dense_ranges, range_blocks
from ..kernels.rows import gather_rows_auto
from .sdpa import attend_lse, attend_sdpa

__all__ = ["FlashAttention4", "Torch", "Triton", "attend", "choose", "side_stream"]

_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """One side stream per device and role (the clean pass's history writes, AnnSA's prior), kept
    for the process: cuBLAS gives every stream it runs on a workspace of its own for its life."""
    if (device, role) not in _SIDE_STREAMS:
        _SIDE_STREAMS[device, role] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device, role]


class Torch:
    """PyTorch alone: SDPA for dense and biased calls (the bias as a mask), the block-sparse kernel's
    torch twin over a whole plan. Where Triton does not run (CPU, macOS, Windows)."""

    name = "torch"
    key_pad = 0  # channels the key storage adds after each key's D

    def side_stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        """The side stream of ``role`` its calls and its cache's history writes run beside the main one on."""
        return side_stream(device, role)

    # -- storage ---------------------------------------------------------------------------
    def new_keys(self, shape: tuple, *, chunk_tokens: int, biased: bool, dtype, device) -> torch.Tensor:
        """Zeroed key rows ``shape`` = [layers, B, rows, H, D] for a cache (zeros: a masked row must
        hold finite values, 0 * NaN = NaN); ``biased``: the cache keeps a key bias (TempCache's log m);
        ``chunk_tokens``: the open chunk's most queries."""
        return torch.zeros(shape, device=device, dtype=dtype)

    def bias_written(self, keys: torch.Tensor, bias: torch.Tensor) -> None:
        """The bias [..., H, L] of ``keys`` [..., L, H, D] (a view of ``new_keys``) changed."""

    def q_rows(self, n: int) -> torch.Tensor | None:
        """Where a model may compute the open chunk's n queries [B, n, H, D] for this backend to read as
        they are; None: anywhere."""
        return None

    @property
    def storage_bytes(self) -> int:
        """Bytes of storage the backend holds beyond the cache's own tensors (a query fold)."""
        return 0

    @staticmethod
    def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows of ``src`` [B, M, H, D] per head: out[b, i, h] = src[b, index[b, h, i], h] (a cache's sort)."""
        return gather_rows_auto(src, index)

    # -- calls -----------------------------------------------------------------------------
    def attend(self, q, k, v, key_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention on [B, L, H, D] tensors; ``key_bias`` [B, H, Lk] an additive logit per key."""
        return attend_sdpa(q, k, v, key_bias=key_bias)

    def biased(self, q, k, v, key_bias: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
        """``attend`` with TempCache's key bias, which is 0 outside keys ``window`` = [lo, hi)."""
        return self.attend(q, k, v, key_bias=key_bias)

    def start_prior(self, q, k, v, fixed: slice, block_q: int):
        """Begin the softmax of q over keys ``fixed`` (the sink and the open chunk) with its log-sum-exp,
        which the block-sparse call then starts from, its first two ranges dropped; None where that call
        reads every range itself."""
        return None

    def sparse(self, q, k, v, ranges, counts, *, block_q: int, key_bias=None, window=None, prior=None,
               layout=None, key_block: int | None = None) -> torch.Tensor:
        """Block-sparse attention of q [B, n, H, D] over k / v [B, Lk, H, D]: query block i (``block_q``
        queries) reads key ranges ``ranges[..., i, :counts[..., i]]`` (``kernels/plan.py``). ``prior``:
        ``start_prior``'s; ``layout``, ``key_block``: the cache's layout and AnnSA's key block (FA4 reads
        the history's picks as lists of them)."""
        if prior is not None:
            prior = prior.wait()
            if prior is not None:
                ranges, counts = ranges[:, :, :, 2:], counts - 2
        out = block_sparse_attention_auto(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranges, counts,
                                          key_bias=key_bias, block_q=block_q, prior=prior, bias_window=window)
        return out.transpose(1, 2)


class _Prior:
    """A prior softmax under way, on a side stream on CUDA: ``wait`` joins it and returns
    (out [B, H, n, D], lse [B, H, n]), or None where cuDNN cannot give it."""

    def __init__(self, q, k, v):
        self.side = None
        if q.is_cuda:
            # the side stream waits for this layer's K/V, and the main stream waits for it before the
            # next call, which orders its reuse of the memory it allocates after the kernel that reads it
            self.side = side_stream(q.device, "prior")
            self.side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            self.value = attend_lse(q, k, v)

    def wait(self):
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.side = None
        return self.value


class Triton(Torch):
    """The block-sparse kernel (``kernels/block_sparse_attention.py``) where a call fits it, the torch
    path where not; cuDNN attends the keys every query reads unbiased and the kernel starts from that
    softmax."""

    name = "triton"

    def biased(self, q, k, v, key_bias, window):
        """On the kernel's all-keys plan on a GPU: cuDNN takes the bias as a full mask tensor and runs
        ~1.5x slower than without it, while the kernel adds it per key tile and skips it outside the
        history. Where the unbiased keys are one span before the history (TempCache's committed sink
        and the open chunk), cuDNN attends them and the kernel only the history, starting from that
        softmax; else the kernel reads all, split in two. Off a GPU (Triton's interpreter), SDPA."""
        if not use_kernel(q, kernel_supports(q, 64), interpreted=False):
            return super().biased(q, k, v, key_bias, window)
        B, Lq, H, _ = q.shape
        lo, hi = window
        prior = attend_lse(q, k[:, :lo], v[:, :lo]) if 0 < lo and hi == k.shape[1] else None
        first = lo if prior is not None else 0
        ranges, counts = _dense_plan(B, H, Lq, first, k.shape[1], q.device)
        out = block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ranges, counts,
                                     key_bias=key_bias, bias_window=window, prior=prior,
                                     num_splits=None if prior is not None else 2)
        return out.transpose(1, 2)

    def start_prior(self, q, k, v, fixed, block_q):
        if not use_kernel(q, kernel_supports(q, block_q)):
            return None
        return _Prior(q, k[:, fixed], v[:, fixed])


@functools.lru_cache(maxsize=None)
def _dense_plan(b: int, h: int, lq: int, first: int, lk: int, device):
    """The all-keys plan over keys [first, lk), one per shape: a rollout at its budget meets one or two."""
    ranges, counts = dense_ranges(b, h, lq, lk - first, 64, device=device)
    return ranges + first, counts


#: Queries per FlashAttention-4 tile: its block sparsity at 64-query tiles ran at about half its
#: 128-query rate, so pairs of 64-query plans are read as their union.
FA4_BLOCK_Q = 128


class FlashAttention4(Triton):
    """FA4 (``kernels/flash4.py``) for calls over many keys (``flash4.MIN_KEYS``: the history's tens of
    thousands, not the prompt's 512): dense, biased with the bias folded into the keys, and AnnSA's
    history picks on its block sparsity joined to cuDNN's prior; the Triton path for the rest.

    A biased cache's keys live here with their bias in ``flash4.KEY_PAD`` more channels, rewritten where
    it changes (``bias_written``), and the open chunk's queries in a fold a model computes them into
    (``q_rows``): a biased call then reads both as they are, where folding per call copied every key
    150 times a chunk."""

    name = "fa4"

    def __init__(self):
        self._keys = None     # the key arena [layers, B, rows, H, D + KEY_PAD] of a biased cache
        self._queries = None  # the query fold [B, chunk tokens, H, D + KEY_PAD]

    def new_keys(self, shape, *, chunk_tokens, biased, dtype, device):
        if not biased:
            return super().new_keys(shape, chunk_tokens=chunk_tokens, biased=biased, dtype=dtype, device=device)
        *lead, d = shape
        self._keys = torch.zeros((*lead, d + flash4.KEY_PAD), device=device, dtype=dtype)
        self._queries = flash4.query_fold(shape[1], chunk_tokens, shape[3], d, dtype, device)
        return self._keys[..., :d]

    @property
    def key_pad(self) -> int:
        return flash4.KEY_PAD if self._keys is not None else 0

    def folded_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """``keys``' view with their folded bias channels where they lie in the arena, else None."""
        arena = self._keys
        if arena is None or keys.untyped_storage().data_ptr() != arena.untyped_storage().data_ptr():
            return None
        return keys.as_strided((*keys.shape[:-1], arena.shape[-1]), keys.stride(), keys.storage_offset())

    def bias_written(self, keys, bias):
        folded = self.folded_keys(keys)
        if folded is not None:
            d = keys.shape[-1]
            flash4.fold_bias_channels(folded[..., d:d + 2], bias, d ** -0.5)

    def q_rows(self, n):
        return None if self._queries is None else self._queries[:, :n, :, :-flash4.KEY_PAD]

    def folded_queries(self, q):
        """q's fold where q is ``q_rows``' view (the model computed it there), else None."""
        qf = self._queries
        if qf is None or q.data_ptr() != qf.data_ptr() or q.stride() != qf.stride() or q.shape[1] > qf.shape[1]:
            return None
        return qf[:, :q.shape[1]]

    @property
    def storage_bytes(self):
        return 0 if self._queries is None else self._queries.nbytes

    @staticmethod
    def _runs(q, k) -> bool:
        return k.shape[1] >= flash4.MIN_KEYS and q.dtype in (torch.float16, torch.bfloat16)

    def attend(self, q, k, v, key_bias=None):
        if self._runs(q, k):
            return flash4.attention(q, k, v, key_bias=key_bias)[0]
        return super().attend(q, k, v, key_bias=key_bias)

    def biased(self, q, k, v, key_bias, window):
        if not self._runs(q, k):
            return super().biased(q, k, v, key_bias, window)
        return flash4.attention(q, k, v, key_bias=key_bias, bias_window=window, folded=self.folded_keys(k),
                                folded_q=self.folded_queries(q))[0]

    def start_prior(self, q, k, v, fixed, block_q):
        if not self._runs(q, k):
            return super().start_prior(q, k, v, fixed, block_q)
        return _Prior(q, k[:, fixed], v[:, fixed])

    def sparse(self, q, k, v, ranges, counts, *, block_q, key_bias=None, window=None, prior=None, layout=None,
               key_block=None):
        if prior is None or layout is None or not self._runs(q, k):
            return super().sparse(q, k, v, ranges, counts, block_q=block_q, key_bias=key_bias, window=window,
                                  prior=prior, layout=layout, key_block=key_block)
        soft = prior.wait()
        if soft is None:
            return super().sparse(q, k, v, ranges, counts, block_q=block_q, key_bias=key_bias, window=window)
        hist = layout.history
        if hist.stop <= hist.start:
            return soft[0].transpose(1, 2)
        # the history's picks (the ranges after the sink's and the chunk's) as lists of key blocks,
        # read over the history's view with its bias, joined to the prior
        blocks = range_blocks(ranges[:, :, :, 2:], counts - 2, hist.start, hist.stop - hist.start, key_block,
                              FA4_BLOCK_Q // block_q)
        bias = None
        if key_bias is not None:  # the bias window, in the history's rows
            lo, hi = window
            window = (min(max(lo - hist.start, 0), hist.stop - hist.start), max(min(hi, hist.stop) - hist.start, 0))
            bias = key_bias[..., hist]
        folded = self.folded_keys(k)
        out, lse = flash4.attention(q, k[:, hist], v[:, hist], key_bias=bias, bias_window=window,
                                    folded=None if folded is None else folded[:, hist],
                                    folded_q=self.folded_queries(q), blocks=blocks,
                                    block_size=(FA4_BLOCK_Q, key_block))
        return flash4.join(soft[0].transpose(1, 2), soft[1], out, lse)


@functools.lru_cache(maxsize=None)
def _family(device: torch.device, dtype: torch.dtype, head_dim: int) -> type:
    """The one place the backend is chosen: FA4 where it runs on the device, dtype and head dim, else
    Triton where Triton runs on the device (CUDA; CPU under its interpreter), else torch."""
    if flash4.available(torch.empty(0, device=device, dtype=dtype)) and head_dim in (64, 128):
        return FlashAttention4
    if triton_runs_on(torch.empty(0, device=device)):
        return Triton
    return Torch


def choose(device, dtype: torch.dtype, head_dim: int) -> Torch:
    """A fresh backend for a rollout's cache on ``device`` of keys in ``dtype`` with head dim ``head_dim``."""
    return _family(torch.device(device), dtype, head_dim)()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_bias: torch.Tensor | None = None):
    """Softmax attention on [B, L, H, D] tensors on the backend of q's device, dtype and head dim
    (attention with no cache: a forward over its own tokens, a measurement's reference); ``key_bias``
    [B, H, Lk] an additive logit per key. A fresh backend each call (the family is chosen once per device,
    dtype and head dim): no state outlives the call."""
    return choose(q.device, q.dtype, q.shape[-1]).attend(q, k, v, key_bias=key_bias)
