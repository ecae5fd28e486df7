"""AnnSA and AnnCA: approximate-nearest-neighbour sparse attention (FAST-AR §5.3-5.4, §6.1).

Queries and keys are hashed by sign-of-random-projection LSH (``bits`` hyperplanes per layer
and head, one fixed seed, the same planes for queries and keys); a query keeps the keys that
share its bucket or one of its ``probes`` radius-1 neighbours (the bits it is least sure of).

**AnnSA** (self-attention). A query block attends ``[sink | its buckets' history keys | own
chunk]``. Cached history never changes after the clean pass writes it, so each layer's history
is hashed and *physically* bucket-sorted once per chunk, right after the clean pass wrote it
(``AnnSA.index_history``): K, V, the TempCache log-count bias and TempCache's per-slot state
are permuted per head in place (``KVCache.permute_rows``), and per-bucket offsets are kept.
Why physical order, not index lists over the existing order: the block-sparse kernel streams
contiguous key *ranges* in tiles of 64; a bucket's keys scattered over the cache would make
one range per key. Sorted, a bucket is one range, adjacent selected buckets fuse into one,
and empty buckets bridge runs, so a query block reads a few long runs of memory. Attention is
a sum over a key *set*, so slot order never changes a dense result; TempCache's history is a
pool of slots whose state is permuted along, and the unbounded cache keeps only frame counts.
(With TempCache, sorting changes which of several equally old slots eviction takes first, a
tie the policy leaves open: at density 1 AnnSA equals dense TempCache until such a tie is
broken differently.) A window cache's ring writes whole frames into frame slots, which a sort
would scatter: AnnSA refuses it (AnnCA works with any cache). The re-sort copies one layer's
history K/V once per chunk (the unbounded cache re-hashes and re-sorts its whole history: a
GEMM with ``bits`` columns and one sort, small next to the attention it saves).

Per step only the chunk's queries are hashed and sorted (``q_perm``); a query block's buckets
become a fixed-size range list on the device (``R = 2 + ceil(2**bits / 2)`` slots, unused ones
ignored by ``range_counts``) that ``block_sparse_attention_auto`` reads. Nothing syncs with the
host: every shape comes from Python integers the schedule knows.

``method='quant'`` keeps the same sorted layout but selects differently: at write time each
block of 64 sorted history keys gets its mean key, int8-quantized; per step a query block
reads the ``keep_fraction`` key blocks whose quantized mean scores highest against any of its
(int8) queries. Its density is fixed by ``keep_fraction``; the bucket method's is data-driven.

**AnnCA** (cross-attention). Per current frame, prompt tokens sharing a bucket (with probes)
with at least one of the frame's queries are kept; if fewer than ``min_tokens`` survive, the
``min_tokens`` best-scoring tokens (against the frame's mean query) join them. Each frame's
kept tokens are gathered to the front of a per-frame key copy (the prompt is a few hundred
tokens) and attended through the same kernel with one range ``[0, kept)``.

Schedule (§6.1): dense for the first ``dense_steps_fraction`` of the denoising steps and in
``dense_layers``; the clean pass counts as the step after the last. With ``calibration_recall``
the first sparse forward over history measures each layer's AnnSA recall (``AnnSA.recall``)
and turns the layers below it dense (``FastARAttention.dense_layers``): the paper applies
sparsity to the ~70% of layers that are measurably sparse.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..kernels import triton_runs_on
from ..kernels.block_sparse_attention import block_sparse_attention_auto
from .errors import FastARError

ANN_METHODS = ("lsh", "quant")
MAX_BITS = 12
KEY_BLOCK = 64  # 'quant': history keys per scored block (the kernel's key tile)

log = logging.getLogger(__name__)
_warned = False


@dataclass(frozen=True)
class AnnConfig:
    """AnnSA / AnnCA settings. ``bits``: LSH hyperplanes (2**bits buckets); ``probes``: how many
    of a query's least certain bits are also flipped (radius-1 probes, 0..bits); ``block_q``:
    queries per block of the sparse kernel; ``min_tokens``: AnnCA's floor of kept prompt tokens.
    ``bits=1, probes=1`` selects every bucket: exactly dense attention.
    ``calibration_recall`` > 0: the first sparse forward over history measures each layer's
    AnnSA recall (dense attention mass inside its plan) and makes layers below it dense.
    ``method='quant'``
    selects for AnnSA, instead of bucket hits, the ``keep_fraction`` best blocks of 64 sorted
    history keys by int8-quantized similarity to their mean keys (AnnCA always uses buckets).
    ``annca`` is off by default: on the sensitized testbed (random prompt features, no real text
    encoder here) it costs more fidelity than dropping the whole cached history
    (bench/results/e2e_bench.json: 37 dB against 43-47 dB)."""
    method: str = "lsh"
    bits: int = 8
    probes: int = 2
    block_q: int = 64
    dense_steps_fraction: float = 0.3
    dense_layers: tuple[int, ...] = ()
    annsa: bool = True
    annca: bool = False
    min_tokens: int = 64
    seed: int = 0
    keep_fraction: float = 0.25
    calibration_recall: float = 0.0

    def __post_init__(self):
        if self.method not in ANN_METHODS:
            raise FastARError(f"AnnConfig.method must be one of {', '.join(ANN_METHODS)}, got {self.method!r}")
        if not _is_int(self.bits) or not 1 <= self.bits <= MAX_BITS:
            raise FastARError(f"AnnConfig.bits must be an integer in [1, {MAX_BITS}], got {self.bits!r}")
        if not _is_int(self.probes) or not 0 <= self.probes <= self.bits:
            raise FastARError(f"AnnConfig.probes must be an integer in [0, bits={self.bits}], got {self.probes!r}")
        if self.block_q not in (64, 128) or isinstance(self.block_q, bool):
            raise FastARError(f"AnnConfig.block_q must be 64 or 128, got {self.block_q!r}")
        f = self.dense_steps_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise FastARError(f"AnnConfig.dense_steps_fraction must lie in [0, 1], got {f!r}")
        try:
            layers = tuple(self.dense_layers)
        except TypeError:
            raise FastARError(f"AnnConfig.dense_layers must be a sequence of layer indices, "
                              f"got {self.dense_layers!r}") from None
        if not all(_is_int(i) and i >= 0 for i in layers):
            raise FastARError(f"AnnConfig.dense_layers must hold integers >= 0, got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", layers)
        for name in ("annsa", "annca"):
            if not isinstance(getattr(self, name), bool):
                raise FastARError(f"AnnConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise FastARError(f"AnnConfig.min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not _is_int(self.seed):
            raise FastARError(f"AnnConfig.seed must be an integer, got {self.seed!r}")
        f = self.keep_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise FastARError(f"AnnConfig.keep_fraction must lie in (0, 1], got {f!r}")
        f = self.calibration_recall
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise FastARError(f"AnnConfig.calibration_recall must lie in [0, 1] (0: no calibration), got {f!r}")

    @property
    def buckets(self) -> int:
        return 1 << self.bits

    def sparse_at(self, layer: int, step: int | None, num_steps: int | None) -> bool:
        """Whether a forward at denoising ``step`` of ``num_steps`` runs sparse in ``layer``
        (unknown step: sparse). The clean pass is step ``num_steps``: sparse unless the fraction is 1."""
        if layer in self.dense_layers:
            return False
        if step is None or num_steps is None:
            return True
        return self.dense_steps_fraction < 1 and step >= round(self.dense_steps_fraction * num_steps)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class LSH:
    """Sign-of-random-projection hashing: ``bits`` Gaussian planes per layer and head, drawn
    once from ``seed`` on the host (so every device gets the same planes)."""

    def __init__(self, bits: int, probes: int, *, num_layers: int, num_heads: int, head_dim: int, seed: int,
                 device):
        g = torch.Generator().manual_seed(seed)
        self.planes = torch.randn(num_layers, num_heads, head_dim, bits, generator=g).to(device)
        self.bits, self.probes = bits, probes
        self.weights = (1 << torch.arange(bits, device=device))

    def project(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, H, D] -> projections [B, H, L, bits] (in x's dtype, fp32 out)."""
        return torch.einsum("blhd,hdk->bhlk", x, self.planes[layer].to(x.dtype)).float()

    def codes(self, proj: torch.Tensor) -> torch.Tensor:
        """Bucket id of each projection row: the packed sign bits (int64)."""
        return ((proj > 0).long() * self.weights).sum(-1)

    def hash(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Bucket ids [B, H, L] of x [B, L, H, D]."""
        return self.codes(self.project(layer, x))

    def probe_codes(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Buckets each row of x [B, L, H, D] probes: its own, then its code with each of its
        ``probes`` smallest-margin bits flipped. Returns [B, H, L, 1 + probes]."""
        proj = self.project(layer, x)
        code = self.codes(proj)
        if not self.probes:
            return code[..., None]
        flip = proj.abs().topk(self.probes, dim=-1, largest=False).indices  # least certain bits
        return torch.cat([code[..., None], code[..., None] ^ (1 << flip)], dim=-1)


def _int8(x: torch.Tensor):
    """Symmetric int8 quantization per (b, h) of x [B, H, N, D]: (int8 values, fp32 scale)."""
    scale = x.abs().amax((-2, -1), keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _hit_buckets(cands: torch.Tensor, group: torch.Tensor, groups: int, buckets: int) -> torch.Tensor:
    """Bool [B, H, groups, buckets]: which buckets the rows of each group probe.
    cands [B, H, L, P] bucket ids; group [L] or [B, H, L] group of each row."""
    b, h, n, p = cands.shape
    hit = torch.zeros(b, h, groups * buckets, dtype=torch.bool, device=cands.device)
    flat = (group.expand(b, h, n)[..., None] * buckets + cands).reshape(b, h, n * p)
    hit.scatter_(-1, flat, True)
    return hit.view(b, h, groups, buckets)


def _warn_twin(q: torch.Tensor) -> None:
    global _warned
    if not _warned and not triton_runs_on(q):
        _warned = True
        log.warning("FAST-AR: Triton cannot run on %s; AnnSA/AnnCA use the torch twin of the "
                    "block-sparse kernel (correct, slow)", q.device)


class AnnSA:
    """Bucket-sorted history of a KV cache and the per-step block plans over it."""

    def __init__(self, config: AnnConfig, cache, lsh: LSH):
        if not cache.ann_sortable:
            raise FastARError("AnnConfig.annsa needs the unbounded cache or TempCache: a window cache's ring "
                              "of frame slots cannot be bucket-sorted (set annsa=False, or change the cache mode)")
        self.config, self.cache, self.lsh = config, cache, lsh
        nb = config.buckets
        self.max_ranges = 2 + (nb + 1) // 2  # sink, own chunk, at most ceil(nb / 2) runs of buckets
        start = cache.sorted_rows(clean_pass=False).start
        # history row where each bucket starts, and its end: [L, B, H, nb + 1] (empty before any write)
        self.offsets = torch.full((cache.num_layers, cache.batch, cache.num_heads, nb + 1), start,
                                  dtype=torch.int32, device=cache.device)
        self.density = torch.ones(cache.num_layers, device=cache.device)  # keys read / keys, last sparse call
        self.reps: list = [None] * cache.num_layers  # 'quant': (int8 block means, scale, block holds keys)

    @torch.no_grad()
    def index_history(self, layer: int) -> None:
        """After the clean pass wrote the layer: hash its history, sort it by bucket in place,
        record the bucket offsets. Empty TempCache slots sort last and join no bucket."""
        cache, nb = self.cache, self.config.buckets
        rows = cache.sorted_rows(clean_pass=True)
        code = self.lsh.hash(layer, cache.k[layer, :, rows])       # [B, H, M]
        filled = cache.filled_rows(layer)
        if filled is not None:
            code = torch.where(filled, code, nb)
        perm = torch.argsort(code, dim=-1, stable=True)
        cache.permute_rows(layer, rows, perm)
        ordered = code.gather(-1, perm)
        edges = torch.arange(nb + 1, device=code.device).expand(*code.shape[:2], nb + 1).contiguous()
        self.offsets[layer] = (rows.start + torch.searchsorted(ordered, edges)).to(torch.int32)
        if self.config.method == "quant":
            self.reps[layer] = self._block_means(cache.k[layer, :, rows], ordered < nb)

    @staticmethod
    def _block_means(k: torch.Tensor, filled: torch.Tensor):
        """int8 means of each block of KEY_BLOCK history keys k [B, M, H, D] over its filled
        keys (filled [B, H, M]); returns (int8 [B, H, nkb, D], fp32 scale [B, H, 1, 1], bool [B, H, nkb])."""
        b, m, h, d = k.shape
        nkb = -(-m // KEY_BLOCK)
        pad = nkb * KEY_BLOCK - m
        w = torch.nn.functional.pad(filled.float(), (0, pad)).view(b, h, nkb, KEY_BLOCK)
        kb = torch.nn.functional.pad(k.float().transpose(1, 2), (0, 0, 0, pad)).view(b, h, nkb, KEY_BLOCK, d)
        count = w.sum(-1)
        mean = (kb * w[..., None]).sum(-2) / count.clamp_min(1)[..., None]
        return _int8(mean) + (count > 0,)

    def _quant_plan(self, layer: int, q: torch.Tensor, q_perm: torch.Tensor, nqb: int):
        """Ranges of the 'quant' method: each query block reads its ``keep_fraction`` best key
        blocks; a key block scores the best int8 dot product of its mean key with any of the
        block's queries (a block mixing two clusters of queries keeps both clusters' keys)."""
        cache, bq = self.cache, self.config.block_q
        b, n, h, d = q.shape
        rows = cache.sorted_rows(clean_pass=False)
        nkb = -(-(rows.stop - rows.start) // KEY_BLOCK)
        top = math.ceil(self.config.keep_fraction * nkb) if self.reps[layer] is not None else 0  # None: no write yet
        ranges = torch.zeros(b, h, nqb, 2 + top, 2, dtype=torch.int32, device=q.device)
        if top:
            k8, _, holds = self.reps[layer]
            qs = q.transpose(1, 2).gather(2, q_perm[..., None].expand(b, h, n, d))   # bucket order
            q8, _ = _int8(torch.nn.functional.pad(qs.float(), (0, 0, 0, nqb * bq - n)))
            pad_rows = (torch.arange(nqb * bq, device=q.device) >= n)[:, None]
            score = torch.stack([  # one head at a time: [B, n, nkb] scores stay small
                (q8[:, i].float() @ k8[:, i].float().transpose(-1, -2)).masked_fill_(pad_rows, float("-inf"))
                .view(b, nqb, bq, nkb).amax(2) for i in range(h)], dim=1)          # [B, H, nqb, nkb]
            score.masked_fill_(~holds[:, :, None], float("-inf"))
            pick = score.topk(top, dim=-1).indices.sort(-1).values                 # [B, H, nqb, top]
            start = rows.start + pick * KEY_BLOCK
            end = torch.clamp(start + KEY_BLOCK, max=rows.stop)
            end = torch.where(holds.gather(-1, pick.flatten(2)).view_as(pick), end, start)  # empty blocks read nothing
            ranges[..., 2:, 0], ranges[..., 2:, 1] = start.to(torch.int32), end.to(torch.int32)
        counts = torch.full((b, h, nqb), 2 + top, dtype=torch.int32, device=q.device)
        return ranges, counts

    def plan(self, layer: int, q: torch.Tensor):
        """Ranges of each query block of q [B, n, H, D] (the open chunk's queries) over the keys
        ``extend`` returned: (q_perm [B, H, n], ranges [B, H, nqb, R, 2], range_counts [B, H, nqb])."""
        cfg, cache, nb = self.config, self.cache, self.config.buckets
        b, n, h, _ = q.shape
        nqb = -(-n // cfg.block_q)
        cands = self.lsh.probe_codes(layer, q)                     # [B, H, n, 1 + probes]
        q_perm = torch.argsort(cands[..., 0], dim=-1, stable=True)
        sink, chunk = cache.sink_rows, cache.chunk_rows()
        if cfg.method == "quant":
            ranges, counts = self._quant_plan(layer, q, q_perm, nqb)
            ranges[..., 0, 1] = sink
            ranges[..., 1, 0], ranges[..., 1, 1] = chunk.start, chunk.stop
            return q_perm, ranges, counts
        cands = cands.gather(2, q_perm[..., None].expand_as(cands))
        block = torch.arange(n, device=q.device) // cfg.block_q
        hit = _hit_buckets(cands, block, nqb, nb)                  # [B, H, nqb, nb]
        off = self.offsets[layer]                                  # [B, H, nb + 1]
        starts, ends = off[..., :-1, None].transpose(-1, -2), off[..., 1:, None].transpose(-1, -2)
        sel = hit | (starts == ends)                               # empty buckets bridge runs
        prev = torch.nn.functional.pad(sel[..., :-1], (1, 0), value=False)
        nxt = torch.nn.functional.pad(sel[..., 1:], (0, 1), value=False)
        run_start, run_end = sel & ~prev, sel & ~nxt
        r = self.max_ranges
        ranges = torch.zeros(b, h, nqb, r + 1, 2, dtype=torch.int32, device=q.device)  # slot r: dump
        for col, flags, edge in ((0, run_start, starts), (1, run_end, ends)):
            slot = torch.where(flags, 2 + torch.cumsum(flags, -1) - 1, r)
            ranges[..., col].scatter_(-1, slot, edge.expand(b, h, nqb, nb))
        ranges[..., 0, 1] = sink
        ranges[..., 1, 0], ranges[..., 1, 1] = chunk.start, chunk.stop
        counts = (2 + run_start.sum(-1)).to(torch.int32)
        return q_perm, ranges[..., :r, :].contiguous(), counts

    @torch.no_grad()
    def recall(self, q, keys, bias, plan, sample_blocks: int = 4) -> torch.Tensor:
        """Dense attention mass inside ``plan`` (``self.plan``'s result), averaged over the
        queries of ``sample_blocks`` query blocks spread over the chunk (device scalar)."""
        q_perm, ranges, counts = plan
        b, n, h, d = q.shape
        nqb, bq, lk = ranges.shape[2], self.config.block_q, keys.shape[1]
        n_pick = min(sample_blocks, nqb)
        picks = sorted({round(i * (nqb - 1) / max(n_pick - 1, 1)) for i in range(n_pick)})
        used = torch.arange(ranges.shape[3], device=q.device) < counts[..., None]        # [B, H, nqb, R]
        key = torch.arange(lk, device=q.device)
        mass = []
        for blk in picks:
            rows = q_perm[:, :, blk * bq:(blk + 1) * bq]                                  # [B, H, r]
            r = ranges[:, :, blk]
            inside = ((key >= r[..., 0, None]) & (key < r[..., 1, None]) & used[:, :, blk, :, None]).any(-2)
            for i in range(h):  # one head at a time: [B, r, Lk] logits stay small
                qs = q[:, :, i].gather(1, rows[:, i, :, None].expand(b, rows.shape[-1], d)).float()
                logits = qs @ keys[:, :, i].float().transpose(1, 2) / math.sqrt(d)
                if bias is not None:
                    logits = logits + bias[:, i, None]
                mass.append((logits.softmax(-1) * inside[:, i, None]).sum(-1).flatten())
        return torch.cat(mass).mean()

    def attention(self, layer: int, q, keys, values, bias, plan=None):
        """Sparse self-attention of q [B, n, H, D] over ``extend``'s keys/values [B, Lk, H, D]."""
        q_perm, ranges, counts = plan if plan is not None else self.plan(layer, q)
        self.density[layer] = plan_density(ranges, counts, keys.shape[1])
        _warn_twin(q)
        out = block_sparse_attention_auto(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                          ranges, counts, key_bias=bias, q_perm=q_perm,
                                          block_q=self.config.block_q)
        return out.transpose(1, 2)


class AnnCA:
    """Per-frame prompt-token selection for cross-attention."""

    def __init__(self, config: AnnConfig, lsh: LSH, tokens_per_frame: int, num_layers: int, device):
        self.config, self.lsh, self.tokens_per_frame = config, lsh, tokens_per_frame
        self.density = torch.ones(num_layers, device=device)  # prompt tokens kept, last sparse call

    def keep(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Kept prompt tokens per frame: bool [B, H, F, Lc] for q [B, F*tpf, H, D], k [B, Lc, H, D]."""
        b, n, h, d = q.shape
        tpf, lc = self.tokens_per_frame, k.shape[1]
        if n % tpf:
            raise FastARError(f"AnnCA: {n} queries are not whole frames of {tpf} tokens")
        frames = n // tpf
        cands = self.lsh.probe_codes(layer, q)                    # [B, H, n, P]
        hit = _hit_buckets(cands, torch.arange(n, device=q.device) // tpf, frames, self.config.buckets)
        code_k = self.lsh.hash(layer, k)                           # [B, H, Lc]
        keep = hit.gather(-1, code_k[:, :, None, :].expand(b, h, frames, lc))
        m = min(self.config.min_tokens, lc)
        if m:
            mean_q = q.view(b, frames, tpf, h, d).float().mean(2).permute(0, 2, 1, 3)   # [B, H, F, D]
            score = mean_q @ k.float().permute(0, 2, 3, 1)                              # [B, H, F, Lc]
            best = torch.zeros_like(keep).scatter_(-1, score.topk(m, dim=-1).indices, True)
            keep = keep | (best & (keep.sum(-1, keepdim=True) < m))
        return keep

    def attention(self, layer: int, q, k, v):
        """Cross-attention of q [B, n, H, D] over the kept prompt tokens of each query's frame."""
        keep = self.keep(layer, q, k)
        b, h, frames, lc = keep.shape
        tpf, bq = self.tokens_per_frame, self.config.block_q
        order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)  # kept tokens first
        kept = keep.sum(-1).to(torch.int32)                                  # [B, H, F]
        self.density[layer] = kept.float().mean() / max(lc, 1)
        kt, vt, qt = k.transpose(1, 2), v.transpose(1, 2), q.transpose(1, 2)
        nqb = -(-tpf // bq)
        counts = torch.ones(b, h, nqb, dtype=torch.int32, device=q.device)
        _warn_twin(q)
        outs = []
        for f in range(frames):
            idx = order[:, :, f, :, None].expand(b, h, lc, kt.shape[-1])
            ranges = torch.zeros(b, h, nqb, 1, 2, dtype=torch.int32, device=q.device)
            ranges[..., 0, 1] = kept[:, :, f, None]
            outs.append(block_sparse_attention_auto(qt[:, :, f * tpf:(f + 1) * tpf], kt.gather(2, idx),
                                                    vt.gather(2, idx), ranges, counts, block_q=bq))
        return torch.cat(outs, dim=2).transpose(1, 2)


def plan_density(ranges: torch.Tensor, counts: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Mean fraction of the ``num_keys`` keys a query block reads (device scalar; telemetry)."""
    used = torch.arange(ranges.shape[-2], device=ranges.device) < counts[..., None]
    length = (ranges[..., 1] - ranges[..., 0]).clamp_min(0) * used
    return length.sum(-1).float().mean() / max(num_keys, 1)


def build_ann(config: AnnConfig, cache) -> tuple[AnnSA | None, AnnCA | None]:
    """AnnSA / AnnCA over a KV cache, as ``config`` switches them on (one shared LSH)."""
    bad = [i for i in config.dense_layers if i >= cache.num_layers]
    if bad:
        raise FastARError(f"AnnConfig.dense_layers {bad} name layers the model does not have "
                          f"({cache.num_layers} layers: 0..{cache.num_layers - 1})")
    lsh = LSH(config.bits, config.probes, num_layers=cache.num_layers, num_heads=cache.num_heads,
              head_dim=cache.head_dim, seed=config.seed, device=cache.device)
    annsa = AnnSA(config, cache, lsh) if config.annsa else None
    annca = AnnCA(config, lsh, cache.tokens_per_frame, cache.num_layers, cache.device) if config.annca else None
    return annsa, annca


__all__ = ["ANN_METHODS", "AnnCA", "AnnConfig", "AnnSA", "LSH", "build_ann", "plan_density"]
