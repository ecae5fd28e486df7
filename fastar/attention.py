"""Attention dispatch: every self-/cross-attention call of a chunk forward lands here.

``FastARAttention`` is the attention state a forward runs under. Self-attention reads the
sink, the history and its own chunk from the KV cache (writing the chunk's own K/V into the
cache's rows first, so no concatenation is ever made); cross-attention attends the prompt
tokens. Every call runs on the cache's attention backend (``fastar.backend``, chosen once per
cache): dense, biased by TempCache's log m, or, where an ``AnnConfig`` schedules sparsity, AnnSA's
block-sparse call / AnnCA's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .annca import AnnCA
from .annsa import AnnSA
from .config import AnnConfig
from .errors import FastARError
from .lsh import LSH
from .backend import choose

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkTelemetry:
    """What a chunk's attention reports as it closes (``FastARAttention.finish_chunk``): each layer's AnnSA
    plan density [num_layers] (a device tensor: read only when asked) and the share of AnnSA's layers that
    ran sparse; both None without AnnSA."""
    annsa_densities: torch.Tensor | None = None
    annsa_sparse: float | None = None
_warned = False
_aside: set = set()  # the cache settings AnnSA stood aside under, said once each


def _version(t: torch.Tensor) -> int | None:
    """A tensor's in-place write counter; None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def build_ann(config: AnnConfig, cache, heads: tuple[slice, int] | None = None) -> tuple[AnnSA | None, AnnCA | None]:
    """AnnSA / AnnCA over a KV cache, as ``config`` switches them on (one shared LSH). ``heads``: where
    the cache holds part of the model's heads (head parallelism), (those heads, how many the model has):
    the LSH draws every head's planes and keeps those, so each head hashes as it does in one process."""
    global _warned
    bad = [i for i in config.dense_layers if i >= cache.num_layers]
    if bad:
        raise FastARError(f"AnnConfig.dense_layers {bad} name layers the model does not have "
                          f"({cache.num_layers} layers: 0..{cache.num_layers - 1})")
    if not _warned and cache.backend.name == "torch":
        _warned = True
        log.warning("FAST-AR: Triton cannot run on %s; AnnSA/AnnCA use the torch twin of the "
                    "block-sparse kernel (correct, slow)", cache.device)
    lsh = LSH(config.bits, config.probes, num_layers=cache.num_layers,
              num_heads=heads[1] if heads is not None else cache.num_heads, head_dim=cache.head_dim,
              seed=config.seed, device=cache.device)
    if heads is not None:
        lsh.planes = lsh.planes[:, heads[0]].contiguous()
    annsa = AnnSA(config, cache, lsh) if config.annsa else None
    if annsa is not None and not annsa.can_pay and cache.config not in _aside:
        _aside.add(cache.config)
        log.warning("FAST-AR: AnnSA stands aside: TempCache's history of %d frames is too short against the %d every "
                    "call reads dense (the sink and the chunk) for a sparse call to pay; it runs from max_cache_frames "
                    "%d on", cache.config.history_frames, cache.config.sink_frames + cache.chunk_frames,
                    annsa.least_budget())
    annca = (AnnCA(config, lsh, cache.tokens_per_frame, cache.num_layers, cache.device, cache.backend)
             if config.annca else None)
    return annsa, annca


class FastARAttention:
    """Routes a forward's attention: through the KV cache when there is one, else dense.

    ``cache`` follows the KV cache protocol (``attend`` in every forward, ``write_history`` in
    the clean pass; the engine opens chunks, ``finish_chunk`` closes them); without one attention is
    dense over the forward's own tokens. ``ann`` (an ``AnnConfig``, needs a cache) makes attention
    AnnSA / AnnCA sparse where its schedule says so; the engine sets ``step`` / ``num_steps`` before
    each forward for it.
    """

    # Its calls sync nothing with the host and keep no per-call tensors: a rollout may replay a
    # chunk of them from a CUDA graph (see ``graph_key``). Subclasses that read results on the
    # host (probes, recorders) set False.
    graph_safe = True
    # (the model's heads the cache holds, the model's head count) where it holds part of them
    # (``fastar.parallel``); None: all
    lsh_heads: tuple[slice, int] | None = None
    # where the cache holds part of the heads, the mean of a tensor over the ranks (AnnSA's densities, so
    # every rank decides as one process does); None: this process decides alone
    densities_mean = None

    def __init__(self, cache=None, ann: AnnConfig | None = None):
        self.cache = cache
        self.backend = cache.backend if cache is not None else None
        self.ann = ann
        self.annsa = self.annca = None
        self._of_context = None            # (context, its version, maker, what it made)
        self.step: int | None = None       # denoising step of the running forward (clean pass: num_steps)
        self.num_steps: int | None = None
        if ann is not None:
            if cache is None:
                raise FastARError("FastARAttention: AnnSA/AnnCA need a KV cache (ann given without one)")
            self.annsa, self.annca = build_ann(ann, cache, self.lsh_heads)

    def kv_rows(self, layer: int):
        """Where a self-attention call's K/V end up (the cache's rows of the open chunk,
        ``KVCache.rows``), for a model to compute them there; None without a cache."""
        return self.cache.rows(layer) if self.cache is not None else None

    def q_rows(self, layer: int):
        """Where a self-attention call's q may be computed (the backend's ``q_rows``: a view of storage its
        biased call then reads as it is); None without a cache or where anywhere will do."""
        if self.cache is None or self.cache.layout is None:
            return None
        chunk = self.cache.layout.chunk
        return self.backend.q_rows(chunk.stop - chunk.start)

    def graph_key(self):
        """The cache's ``graph_key`` and AnnSA's (``AnnSA.graph_key``): equal keys, equal kernels."""
        return self.cache.graph_key(), None if self.annsa is None else self.annsa.graph_key()

    def finish_chunk(self) -> ChunkTelemetry:
        """Close the open chunk: the share of AnnSA's layers that ran sparse in it (read while its layout
        is open), the cache's commit, then AnnSA's review of its plans (which layers' sparse calls pay
        from the next chunk on). What a chunk's report, the cache widget and the benchmarks read."""
        if self.annsa is None:
            self.cache.commit()
            return ChunkTelemetry()
        sparse = self.annsa.sparse_share
        self.cache.commit()
        return ChunkTelemetry(self.annsa.review(self.densities_mean), sparse)

    def begin_clean_pass(self) -> None:
        """The next forward is the clean pass: its K/V become the cache's history, and it runs as the
        step after the last (``num_steps``), as AnnSA's schedule counts it. The one place a rollout, a
        replayed chunk graph and a re-encoding pass make this transition."""
        self.cache.begin_clean_pass()
        self.step = self.num_steps

    def _sparse(self, layer: int) -> bool:
        return self.ann.sparse_at(layer, self.step, self.num_steps)

    def self_attention(self, layer: int, q, k, v):
        if self.cache is None:
            return self._backend(q).attend(q, k, v)
        keys, values, bias = self.cache.attend(layer, k, v)
        if self.annsa is not None and self._sparse(layer) and self.annsa.runs(layer):
            out = self.annsa.attention(layer, q, keys, values, bias)
        elif bias is not None:
            out = self.backend.biased(q, keys, values, bias, self.cache.layout.bias)
        else:
            out = self.backend.attend(q, keys, values)
        if self.cache.clean_pass:
            self.write_history(layer, q)
        return out

    def fill_cache(self, layer: int, q, k, v) -> None:
        """The clean pass's K/V of a layer whose attention output nobody reads (the last one's:
        ``WanModel.forward(fill_cache=True)``): written, with the history writes, not attended."""
        if self.cache is None or not self.cache.clean_pass:
            raise FastARError("FastARAttention.fill_cache is for the clean pass of a cached rollout")
        self.cache.attend(layer, k, v)
        self.write_history(layer, q)

    def write_history(self, layer: int, q) -> None:
        """The clean pass's writes of one layer's history: TempCache's merge, AnnSA's sort. Only
        the next chunk reads them, so on CUDA they run on a side stream and overlap the rest of
        the pass (layers after this one never touch this layer's cache); ``KVCache.join_writes``
        (the engine's, after the pass, and ``commit``'s) ends them."""
        index = self.annsa is not None and layer not in self.ann.dense_layers and self.annsa.indexes(layer)

        def write():
            if self.cache.writes_history:
                self.cache.write_history(layer, q)
            if index:
                self.annsa.index_history(layer)

        # a side stream only where there is device work to overlap: a TempCache merge or a re-sort
        if q.is_cuda and (self.cache.writes_history or index):
            self.cache.write_aside(write, q)
        else:
            write()

    def of_context(self, context: torch.Tensor, make):
        """What a model makes of the rollout's ``context`` alone (every layer's cross-attention K/V of a
        text, a world's poses from its actions): ``make(context)`` once, then kept while the same tensor
        comes back unwritten to the same ``make`` (a model's bound method: one state may serve two
        models): the context conditions every forward, and remaking it is work for nothing. Made every time:
        an inference tensor's (it counts no writes), and inside a CUDA-graph capture a context not
        kept already (its tensors would live in the graph's memory pool)."""
        version = _version(context)
        memo = self._of_context
        if version is not None and memo is not None and memo[0] is context and memo[1:3] == (version, make):
            return memo[3]
        kv = make(context)
        if not (context.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._of_context = (context, version, make, kv)
        return kv

    def cross_attention(self, layer: int, q, k, v):
        if self.annca is not None and self._sparse(layer):
            return self.annca.attention(layer, q, k, v)
        return self._backend(q).attend(q, k, v)

    def _backend(self, q):
        """The cache's backend; with no cache, one chosen at the first call from q's device, dtype and head dim."""
        if self.backend is None:
            self.backend = choose(q.device, q.dtype, q.shape[-1])
        return self.backend
