"""TempCache: KV-cache compression by temporal correspondence (FAST-AR §5.2, Lemma 5.1).

When the clean pass writes a chunk, each new token finds its top-1 nearest cached history token
(the cosine of whole tokens, all heads concatenated: one match per token, where per-head matching
costs a match per head for no more of the attention kept). A pair whose keys'
cosine similarity clears ``merge_threshold`` joins one group: the newest key becomes the group's
representative, the value is the running mean of the group's values, and the group size m
enters attention as the logit bias log m.
For identical keys this is exact: softmax over groups of (q.k/sqrt(d) + log m) weighting the
group means equals attention over every member. Unmatched tokens take the least recently
refreshed history slots (among equally old ones, the earliest written token positions), so
the cache never exceeds ``max_cache_frames`` frames of tokens: memory is flat by construction.
Which slot holds a key never decides anything, so AnnSA may reorder slots freely. Sink frames
are never merged or evicted.

All of it runs on the device with fixed shapes (no host sync): per head, every history slot
has a count (0 = empty) and the frame of its newest member; discarded writes go to one spare
"dump" token slot after the cache.
"""
from __future__ import annotations

import torch

from ..kernels.merge_rows import merge_rows_auto
from ..kernels.pair_cosine import pair_cosine_auto
from ..kernels.row_argmax import row_argmax_auto
from ..kernels.rows import gather_rows_auto, scatter_rows_auto
from ..kernels.unit_fp8 import unit_fp8_auto
from .config import CacheConfig, TempCacheConfig, check_settings
from .kvcache import CacheStats, FrameCache, KVCache, Layout
from .recall import Recall


def _fp8_gemm(device: torch.device) -> bool:
    """Whether the device has fp8 tensor cores (compute capability 8.9 on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _top1_fp8(x: torch.Tensor, keys: torch.Tensor, canon: torch.Tensor | None, held: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of the cosine of tokens x [N, H, D] against the history's tokens keys [M, H, D]
    (heads lined up through ``canon`` [H, M] where given: token m of head h is ``keys[canon[h, m],
    h]``; ``held`` [M]: whether token m holds a key, empty ones score 0) on fp8 tensor cores.

    Why: the match's GEMM is as large as a layer's projections, and fp8 runs it at twice bf16's
    rate; both operands go to unit norm x 256 in fp8 in one kernel each (``kernels/unit_fp8.py``:
    the history's side reads the keys once, through the head alignment). The
    caller recomputes the winner's cosine in fp32, so only near-ties (~1e-3) may pick another
    slot than bf16 scores would."""
    n, m = x.shape[0], held.shape[0]
    x8 = unit_fp8_auto(x, m_out=-(-n // 16) * 16)  # rows padded to a multiple of 16, as fp8 GEMMs need
    k8 = unit_fp8_auto(keys, canon, held, m_out=-(-m // 16) * 16)
    one = torch.ones((), device=x.device)
    idx = torch.cat([row_argmax_auto(torch._scaled_mm(x8[i:i + 1024], k8.T, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16))
                     for i in range(0, x8.shape[0], 1024)])[:n]
    # a padding row scores 0, like an empty slot: it wins only where no filled slot scores above
    # 0, which never merges; clamped into range all the same
    return idx.clamp_max(m - 1)


class TempCache(KVCache):
    """Rows ``[sink | open chunk | recall | history slots | dump]``: the open chunk sits right after the
    sink, so the keys every query reads dense and unbiased are one span (``Layout.fixed``: one
    cuDNN call); ``recall_frames`` frame rows of the memory tier (``fastar.recall``) follow it, in that
    span once all are filled.
    The history's key bias is log m (-inf on empty slots); per layer, batch and head, every history slot
    has its group size ``_count`` (0 = empty), the frame of its newest member ``_newest`` and that
    member's position in its write ``_token``; ``_canon[l, b, h, i]``
    is head h's slot of token i (every head holds the same tokens, each in its own slot order
    once AnnSA sorts them). That merge state is the cache's own: callers see log m (``attend``,
    ``held_keys``), ``stats`` and ``observer``. Wherever log m changes the cache tells its attention
    backend (``bias_written``), which may keep it beside the keys (FlashAttention-4's fold)."""

    has_bias = True
    writes_history = True

    def __init__(self, config: TempCacheConfig, **geometry):
        chunk_frames, tpf = geometry["chunk_frames"], geometry["tokens_per_frame"]
        check_settings(config, None, chunk_frames)
        super().__init__(config, capacity_frames=config.max_cache_frames + chunk_frames + config.recall_frames,
                         spare_tokens=1, **geometry)
        # the recall rows before the history: once every one is filled they are read dense and unbiased
        # beside the sink and the open chunk (``Layout.fixed``: cuDNN's rate, not the biased kernel's)
        self.recall_rows = self._rows(config.sink_frames + chunk_frames, config.recall_frames)
        self.history = self._rows(config.sink_frames + chunk_frames + config.recall_frames, config.history_frames)
        self.recall = (Recall(config.recall_frames, num_layers=self.num_layers, batch=self.batch,
                              num_heads=self.num_heads, head_dim=self.head_dim, tokens_per_frame=tpf,
                              chunk_frames=chunk_frames, history_frames=config.history_frames, device=self.device,
                              dtype=self.dtype)
                       if config.recall_frames else None)
        self.dump = self.k.shape[2] - 1
        shape = (self.num_layers, self.batch, self.num_heads, self.history.stop - self.history.start)
        device = self.device
        self._count = torch.zeros(shape, device=device)
        self._newest = torch.full(shape, -1, dtype=torch.long, device=device)
        self._token = torch.zeros(shape, dtype=torch.int32, device=device)
        self._canon = torch.arange(shape[-1], device=device).expand(shape).contiguous()
        # per-layer telemetry of the last write: merged, evicted (device scalars, read once per chunk)
        self._merged = torch.zeros(self.num_layers, dtype=torch.long, device=device)
        self._evicted = torch.zeros(self.num_layers, dtype=torch.long, device=device)
        # observer(layer, batch, slots [H, N]): the history slot each token of a merge went to (its group's or
        # its own; -1: dropped), in slot order as written (a measurement's hook: it may read them on the host)
        self.observer = None
        # frame of each token the open chunk's clean pass merges (a fixed buffer: a chunk's
        # forwards may be replayed from a CUDA graph, which reads it)
        self._new_frames_buf = torch.empty(chunk_frames * tpf, dtype=torch.long, device=device)
        self.log_count_bias[..., self._rows(0, config.sink_frames)] = float("-inf")  # empty
        self.log_count_bias[..., self.recall_rows.start:self.history.stop] = float("-inf")
        self._fold_bias(slice(None), slice(0, self.history.stop))

    def _fold_bias(self, layers, rows: slice) -> None:
        """Tell the backend that log m of ``rows`` in ``layers`` changed. Every row outside the layout's
        bias window (the filled sink, the open chunk) has log m = 0, so log m is the bias as a call applies it."""
        self.backend.bias_written(self.k[layers, :, rows], self.log_count_bias[layers, ..., rows])

    def _begin(self, frames: int) -> Layout:
        sink, tpf = self.config.sink_frames, self.tokens_per_frame
        self._open = (sink, frames)
        chunk = self._rows(sink, frames)
        # a short chunk leaves rows between it and the history: empty (-inf) like unfilled slots
        scratch = self.log_count_bias[..., self._rows(sink, self.chunk_frames)]
        scratch.zero_()
        scratch[..., frames * tpf:] = float("-inf")
        self._fold_bias(slice(None), self._rows(0, sink + self.chunk_frames))  # the committed sink, this chunk
        sink_in_chunk = max(0, min(frames, sink - self.frames_cached))  # the chunk's frames that join the sink
        self._new = self._rows(sink + sink_in_chunk, frames - sink_in_chunk)
        first_new = self.frames_cached + sink_in_chunk
        n = self._new.stop - self._new.start
        self._new_frames = self._new_frames_buf[:n]
        self._new_frames.copy_(torch.arange(first_new, self.frames_cached + frames, device=self.device)
                               .repeat_interleave(tpf, output_size=n))
        # a whole chunk and recall rows all filled (they stay filled): one unbiased span through them
        dense = self.recall_rows.stop if frames == self.chunk_frames and self.recall is not None and \
            self.recall.full else chunk.stop
        fixed = slice(0, dense) if self.frames_held >= sink else None
        end = self.history.stop
        return Layout(chunk=chunk, attended=end, sink=sink * tpf, history=self.history, fixed=fixed,
                      bias=(fixed.stop if fixed is not None else 0, end), resort=self.history)

    def frame_slot(self, frame: int) -> int | None:
        return frame if frame < self.config.sink_frames else None  # later frames merged at write_history

    def _held(self, frames_cached: int) -> int:
        return min(frames_cached, self.config.sink_frames)

    def write_history(self, layer: int, q: torch.Tensor) -> None:
        """Merge the layer's new tokens (the chunk's frames past the sink) into the history; the memory tier
        notes the queries that choose what it recalls next."""
        if self._new.stop > self._new.start:
            self._merge(layer, self._new)
        if self.recall is not None:
            self.recall.note_queries(layer, q)

    def commit(self) -> None:
        """The chunk becomes history; with a memory tier its frames are archived, and the recall rows take the
        frames the tier chose (``Recall.commit``)."""
        new = self._new
        super().commit()
        if self.recall is None:
            return
        self.recall.commit(self.k, self.v, self.recall_rows, self.log_count_bias, new)
        self._fold_bias(slice(None), self.recall_rows)

    def _match(self, new_k: torch.Tensor, hist_k: torch.Tensor, filled: torch.Tensor, canon: torch.Tensor):
        """Top-1 counterpart of each new token among the filled history slots, and the keys'
        cosine similarity: whole tokens (all heads concatenated) compared, each head's keys read
        through canon. new_k [N, H, D]; hist_k [M, H, D]; filled, canon [H, M]. Returns (slot
        [H, N], cosine [H, N]). On fp8 tensor cores, else a plain GEMM (cuBLAS) in query blocks
        against the keys at unit norm (empty slots at zero); then the exact fp32 cosine."""
        n, h, d = new_k.shape
        held = filled[0].gather(0, canon[0])
        if _fp8_gemm(new_k.device):
            idx = _top1_fp8(new_k, hist_k, canon, held)
        else:
            keys = gather_rows_auto(hist_k[None], canon[None])[0].reshape(-1, h * d)
            norm = torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
            unit = keys * torch.where(held, 1.0 / norm.clamp_min(1e-12), 0.0).to(keys.dtype)[:, None]
            x = new_k.reshape(n, h * d)
            idx = torch.cat([(x[i:i + 1024] @ unit.T).argmax(dim=-1) for i in range(0, n, 1024)])
        slot = canon[:, idx]
        return slot, pair_cosine_auto(new_k, hist_k, slot).expand(h, n)

    @staticmethod
    def _identity(newest: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
        """A slot's token as one sortable int64: its newest frame, then its write position (empty
        slots, frame -1, sort first). Oldest first: the eviction order."""
        return newest * (1 << 32) + written

    @classmethod
    def _eviction_order(cls, newest: torch.Tensor, written: torch.Tensor, canon: torch.Tensor) -> torch.Tensor:
        """Each head's slots [H, M], least recently refreshed first: the tokens are sorted once and
        the order read out in each head's slots through ``canon``, so a new token takes the slots
        of one token in every head (empty slots tie), which keeps canon valid."""
        tokens = torch.argsort(cls._identity(newest[0], written[0]).gather(0, canon[0]))
        return canon.gather(1, tokens.expand_as(canon))

    @torch.no_grad()
    def _merge(self, layer: int, new: slice) -> None:
        """Merge rows ``new`` of the layer's K/V into its history slots; each new token's frame is
        ``_new_frames``; the key bias gets log m; every discarded write goes to the dump row."""
        k, v, bias = self.k[layer], self.v[layer], self.log_count_bias[layer]
        hist, new_frames, dump = self.history, self._new_frames, self.dump
        cfg = self.config
        b_size, _, h, d = k.shape
        m_slots, n = hist.stop - hist.start, new.stop - new.start
        heads = torch.arange(h, device=k.device)
        token = torch.arange(n, device=k.device)
        merged_total = evicted_total = 0
        for b in range(b_size):
            count, newest, written = self._count[layer, b], self._newest[layer, b], self._token[layer, b]  # [H, M]
            canon = self._canon[layer, b]
            kb, vb = k[b], v[b]
            new_k, new_v = kb[new], vb[new]                              # [N, H, D]
            filled = count > 0
            if cfg.enabled:
                at, cos = self._match(new_k, kb[hist], filled, canon)    # [H, N] slot of each token's match
                merge = (cos >= cfg.merge_threshold) & filled.gather(1, at)
            else:
                at = torch.zeros(h, n, dtype=torch.long, device=k.device)
                merge = torch.zeros(h, n, dtype=torch.bool, device=k.device)
            slot = (heads[:, None] * m_slots + at).flatten()             # flat slot (head-major)
            # group sizes, representatives (newest = largest token index: later frame) and values;
            # an unmerged token adds 0 and -1 at its match rather than at one shared dump slot,
            # whose atomics serialize
            added = torch.zeros(h * m_slots, device=k.device).index_add_(0, slot, merge.flatten().float())
            rep = torch.full((h * m_slots,), -1, dtype=torch.long, device=k.device)
            rep.scatter_reduce_(0, slot, torch.where(merge, token, -1).flatten(), "amax")
            added, rep = added.view(h, m_slots), rep.view(h, m_slots)
            merge_rows_auto(kb[hist], vb[hist], new_k, new_v, at, merge, count, added, rep)
            rep_frame = torch.where(rep >= 0, new_frames[rep.clamp_min(0)], newest)
            newest.copy_(torch.where(added > 0, rep_frame, newest))
            written.copy_(torch.where(added > 0, rep, written))
            count.add_(added)
            # unmatched tokens take the least recently refreshed slots (empty ones first; ties by
            # write position, never by slot index)
            order = self._eviction_order(newest, written, canon)        # [H, M]
            fresh = ~merge
            pos = torch.cumsum(fresh.long(), dim=1) - 1
            place = fresh & (pos < m_slots)
            dest = order.gather(1, pos.clamp(0, m_slots - 1))              # [H, N] slot per token
            evicted = place & count.gather(1, dest).gt(0)
            rows_new = torch.where(place, hist.start + dest, dump)[None]     # [1, H, N] token rows
            scatter_rows_auto(kb[None], rows_new, new_k[None])
            scatter_rows_auto(vb[None], rows_new, new_v[None])
            slot_new = torch.where(place, heads[:, None] * m_slots + dest, h * m_slots).flatten()
            for state, value in ((count, torch.ones(h * n, device=k.device)),
                                 (newest, new_frames.expand(h, n).flatten()),
                                 (written, token.expand(h, n).flatten())):
                padded = torch.cat([state.flatten(), state.new_zeros(1)])
                padded.index_copy_(0, slot_new, value.to(state.dtype))
                state.copy_(padded[:-1].view(h, m_slots))
            bias[b, :, hist] = torch.where(count > 0, count.clamp_min(1).log(), float("-inf"))
            if self.observer is not None:
                self.observer(layer, b, torch.where(merge, at, torch.where(place, dest, -1)))
            merged_total = merged_total + merge.sum()
            evicted_total = evicted_total + evicted.sum()
        self._merged[layer] = merged_total
        self._evicted[layer] = evicted_total
        self._fold_bias(layer, hist)

    @torch.no_grad()
    def sort_history(self, layer: int, perm: torch.Tensor) -> None:
        """Reorder history slots per head; the slot state follows (eviction breaks ties by write
        position, never by slot index, so no decision changes)."""
        super().sort_history(layer, perm)
        for state in (self._count[layer], self._newest[layer], self._token[layer]):
            state.copy_(state.gather(-1, perm))
        new_slot = torch.empty_like(perm).scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device)
                                                   .expand_as(perm))  # old slot -> new slot
        self._canon[layer].copy_(new_slot.gather(-1, self._canon[layer]))
        self._fold_bias(layer, self.history)

    def stats(self) -> CacheStats:
        """Sizes after the last commit (reads a few device scalars)."""
        base = super().stats()
        per_head = self.num_layers * self.batch * self.num_heads
        held = (self._count > 0).float().sum(-1).mean((1, 2))  # filled slots per layer
        state = sum(t.nbytes for t in (self._count, self._newest, self._token, self._canon))
        recall = self.recall
        recalled = recall.recalled() * self.tokens_per_frame if recall is not None else 0
        return CacheStats(
            frames_cached=base.frames_cached,
            tokens_held=base.tokens_held + round(held.mean().item()) + recalled,
            dense_tokens=base.dense_tokens,
            capacity_tokens=base.capacity_tokens,
            bytes=base.bytes + state + (recall.device_bytes if recall is not None else 0),
            bytes_per_token=base.bytes_per_token,
            merged=round(self._merged.sum().item() / per_head),
            evicted=round(self._evicted.sum().item() / per_head),
            recalled=recalled,
            host_bytes=recall.archived * recall.bytes_per_frame if recall is not None else 0,
        )


def make_cache(config: CacheConfig | TempCacheConfig, *, tempcache=TempCache, **geometry) -> KVCache:
    """The cache a config names, over ``geometry`` (num_layers, batch, num_heads, head_dim,
    tokens_per_frame, chunk_frames, max_frames (the unbounded cache's size), device, dtype, backend (the
    attention backend; None: ``fastar.backend.choose``'s)); ``tempcache``: the class a TempCache config
    makes (head parallelism's, which decides on whole tokens across ranks)."""
    if isinstance(config, TempCacheConfig):
        geometry.pop("max_frames", None)
        return tempcache(config, **geometry)
    return FrameCache(config, **geometry)
