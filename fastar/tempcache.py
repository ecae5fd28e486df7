"""TempCache: KV-cache compression by temporal correspondence (FAST-AR §5.2, Lemma 5.1).

When the clean pass writes a chunk, each new token finds its top-1 nearest cached history key
(``kernels.correspondence``). A pair whose key cosine similarity clears ``merge_threshold``
joins one group: the newest key becomes the group's representative, the value is the running
mean of the group's values, and the group size m enters attention as the logit bias log m.
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

from dataclasses import dataclass

import torch

from ..kernels.correspondence import top1_correspondence
from ..kernels.gather_rows import gather_rows_auto
from ..kernels.merge_rows import merge_rows_auto
from ..kernels.pair_cosine import pair_cosine_auto
from ..kernels.row_argmax import row_argmax_auto
from ..kernels.scatter_rows import scatter_rows_auto
from ..kernels.unit_fp8 import unit_fp8_auto
from .errors import FastARError

MATCHING_MODES = ("key", "query")
GROUPING_MODES = ("head", "shared")


@dataclass(frozen=True)
class TempCacheConfig:
    """``enabled=False`` keeps the same budget with eviction only (no merging): the baseline
    TempCache is measured against. ``matching``: find each new token's counterpart by its key
    (cosine) or by its query (attention argmax, as DiffTrack); either way the pair merges only
    if the keys' cosine similarity clears the threshold. ``grouping``: per head, or one
    correspondence shared by all heads (cosine over the concatenated heads).

    Defaults from bench/results/tempcache_*.json (real-video keys, H200): key matching beats
    query matching at every threshold; shared grouping matches per-head recall at a third of
    the matching cost. On the sensitized testbed (concentrated attention, bench/testbed.py)
    0.95 is the best threshold at the 21-frame budget: recall 0.937 (history alone 0.69,
    against 0.46 for the same budget without merging); 0.9 merges too eagerly (0.82)."""
    enabled: bool = True
    merge_threshold: float = 0.95
    max_cache_frames: int = 21
    sink_frames: int = 3
    matching: str = "key"
    grouping: str = "shared"

    def __post_init__(self):
        if not isinstance(self.merge_threshold, (int, float)) or not 0.0 < self.merge_threshold <= 1.0:
            raise FastARError(f"TempCacheConfig.merge_threshold must lie in (0, 1] (a cosine similarity), "
                              f"got {self.merge_threshold!r}")
        if not isinstance(self.sink_frames, int) or self.sink_frames < 0:
            raise FastARError(f"TempCacheConfig.sink_frames must be an integer >= 0, got {self.sink_frames!r}")
        if not isinstance(self.max_cache_frames, int) or self.max_cache_frames <= self.sink_frames:
            raise FastARError(f"TempCacheConfig.max_cache_frames must be an integer > sink_frames "
                              f"({self.sink_frames}), got {self.max_cache_frames!r}")
        if self.matching not in MATCHING_MODES:
            raise FastARError(f"TempCacheConfig.matching must be one of {', '.join(MATCHING_MODES)}, "
                              f"got {self.matching!r}")
        if self.grouping not in GROUPING_MODES:
            raise FastARError(f"TempCacheConfig.grouping must be one of {', '.join(GROUPING_MODES)}, "
                              f"got {self.grouping!r}")

    @property
    def history_frames(self) -> int:
        return self.max_cache_frames - self.sink_frames


def _fp8_gemm(device: torch.device) -> bool:
    """Whether the device has fp8 tensor cores (compute capability 8.9 on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _top1_fp8(x: torch.Tensor, keys: torch.Tensor, canon: torch.Tensor | None, held: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of the cosine of tokens x [N, H, D] against the history's tokens keys [M, H, D]
    (heads lined up through ``canon`` [H, M] where given: token m of head h is ``keys[canon[h, m],
    h]``; ``held`` [M]: whether token m holds a key, empty ones score 0) on fp8 tensor cores.

    Why: the match's GEMM is as large as a layer's projections, and fp8 runs it at twice bf16's
    rate; both operands go to unit norm x 256 in fp8 in one kernel each (``kernels/unit_fp8.py``:
    the history's side reads the keys once, through the head alignment; bench/NOTES.md). The
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


class TempCache:
    """Per-slot merge state of a KVCache's history region, and the merge itself."""

    def __init__(self, config: TempCacheConfig, *, num_layers: int, batch: int, num_heads: int,
                 history_tokens: int, new_tokens: int, device):
        self.config = config
        shape = (num_layers, batch, num_heads, history_tokens)
        self.count = torch.zeros(shape, device=device)                  # group size m, 0 = empty
        self.newest = torch.full(shape, -1, dtype=torch.long, device=device)  # frame of the representative
        self.token = torch.zeros(shape, dtype=torch.int32, device=device)     # its position in its write
        # per-layer telemetry of the last write: merged, evicted (device scalars, read once per chunk)
        self.merged = torch.zeros(num_layers, dtype=torch.long, device=device)
        self.evicted = torch.zeros(num_layers, dtype=torch.long, device=device)
        # history slot each token of the last write went to (-1: dropped), per layer and head
        self.last_slots = torch.full((num_layers, batch, num_heads, new_tokens), -1, dtype=torch.long, device=device)
        # shared grouping: every head holds the same tokens, each in its own slot order once AnnSA
        # sorts them; canon[l, b, h, i] is head h's slot of token i, the same token in every head
        self.canon = None
        if config.grouping == "shared":
            self.canon = torch.arange(history_tokens, device=device).expand(shape).contiguous()

    def match(self, x: torch.Tensor, new_k: torch.Tensor, hist_k: torch.Tensor, filled: torch.Tensor,
              canon: torch.Tensor | None = None):
        """Top-1 counterpart of each new token among the filled history slots, and the keys'
        cosine similarity. x: matching features [N, H, D]; new_k [N, H, D]; hist_k [M, H, D];
        filled [H, M] bool; canon [H, M] (shared grouping): head h's slot of each token, the same
        token in every head. Returns (slot [H, N], cosine [H, N]).

        Shared grouping compares whole tokens (all heads concatenated), each head's keys read
        through canon, since AnnSA sorts each head's slots apart."""
        n, h, d = new_k.shape
        if self.config.grouping == "shared":
            # one correspondence over the concatenated heads: on fp8 tensor cores, else a plain
            # GEMM (cuBLAS) in query blocks against the keys at unit norm (empty slots at zero);
            # then the exact fp32 cosine of the chosen pair
            held = filled[0].gather(0, canon[0])
            if self.config.matching == "key" and _fp8_gemm(x.device):
                idx = _top1_fp8(x, hist_k, canon, held)
            else:
                keys = gather_rows_auto(hist_k[None], canon[None])[0].reshape(-1, h * d)
                if self.config.matching == "query":
                    scale = held.float()  # plain q.k argmax over filled slots
                else:
                    norm = torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
                    scale = torch.where(held, 1.0 / norm.clamp_min(1e-12), 0.0)
                unit = keys * scale.to(keys.dtype)[:, None]
                x = x.reshape(n, h * d)
                idx = torch.cat([(x[i:i + 1024] @ unit.T).argmax(dim=-1) for i in range(0, n, 1024)])
            slot = canon[:, idx]
            return slot, pair_cosine_auto(new_k, hist_k, slot).expand(h, n)
        norm = torch.linalg.vector_norm(hist_k, dim=-1, dtype=torch.float32).transpose(0, 1)  # [H, M]
        scale = torch.where(filled, 1.0 / norm.clamp_min(1e-12), 0.0)
        if self.config.matching == "query":
            scale = filled.float()  # plain q.k argmax over filled slots
        idx, _ = top1_correspondence(x.transpose(0, 1), hist_k.transpose(0, 1), None, scale)
        best = torch.gather(hist_k.transpose(0, 1), 1, idx.clamp_min(0)[..., None].expand(h, n, d)).float()
        cos = torch.cosine_similarity(new_k.transpose(0, 1).float(), best, dim=-1)
        return idx, cos

    @staticmethod
    def _identity(newest: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
        """A slot's token as one sortable int64: its newest frame, then its write position (empty
        slots, frame -1, sort first). Oldest first: the eviction order."""
        return newest * (1 << 32) + written

    @classmethod
    def _eviction_order(cls, newest: torch.Tensor, written: torch.Tensor, canon: torch.Tensor | None) -> torch.Tensor:
        """Each head's slots [H, M], least recently refreshed first. With ``canon`` the tokens are
        sorted once and the order read out in each head's slots: a new token then takes the slots
        of one token in every head (empty slots tie), which keeps canon valid."""
        if canon is None:
            return torch.argsort(cls._identity(newest, written), dim=1)
        tokens = torch.argsort(cls._identity(newest[0], written[0]).gather(0, canon[0]))
        return canon.gather(1, tokens.expand_as(canon))

    @torch.no_grad()
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, q: torch.Tensor | None,
              hist: slice, new: slice, new_frames: torch.Tensor, dump: int) -> None:
        """Merge the chunk's new tokens (rows ``new`` of k/v [B, T, H, D]) into the history
        rows ``hist``; ``new_frames`` [N] is each new token's frame; ``bias`` [B, H, T] gets log m.
        Token row ``dump`` receives every discarded write."""
        cfg = self.config
        b_size, _, h, d = k.shape
        m_slots, n = hist.stop - hist.start, new.stop - new.start
        heads = torch.arange(h, device=k.device)
        token = torch.arange(n, device=k.device)
        merged_total = evicted_total = 0
        for b in range(b_size):
            count, newest, written = self.count[layer, b], self.newest[layer, b], self.token[layer, b]  # [H, M]
            canon = None if self.canon is None else self.canon[layer, b]
            kb, vb = k[b], v[b]
            new_k, new_v = kb[new], vb[new]                              # [N, H, D]
            filled = count > 0
            if cfg.enabled:
                x = new_k if cfg.matching == "key" else q[b, -n:]
                idx, cos = self.match(x, new_k, kb[hist], filled, canon)
                at = idx.clamp_min(0)                                    # [H, N] slot of each token's match
                merge = (cos >= cfg.merge_threshold) & filled.gather(1, at) & (idx >= 0)
            else:
                idx = at = torch.zeros(h, n, dtype=torch.long, device=k.device)
                merge = torch.zeros(h, n, dtype=torch.bool, device=k.device)
            slot = (heads[:, None] * m_slots + at).flatten()             # flat slot (head-major)
            # group sizes, representatives (newest = largest token index: later frame) and values;
            # an unmerged token adds 0 and -1 at its match rather than at one shared dump slot,
            # whose atomics serialize (~0.1 ms a layer on an H200 at Wan 1.3B's shapes)
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
            self.last_slots[layer, b, :, -n:] = torch.where(merge, idx, torch.where(place, dest, -1))
            merged_total = merged_total + merge.sum()
            evicted_total = evicted_total + evicted.sum()
        self.merged[layer] = merged_total
        self.evicted[layer] = evicted_total

    def held_tokens(self) -> torch.Tensor:
        """Filled history slots per layer, averaged over batch and heads (device tensor)."""
        return (self.count > 0).float().sum(-1).mean((1, 2))
