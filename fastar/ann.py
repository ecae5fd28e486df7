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
pool of slots whose state is permuted along (its eviction breaks ties by write position, never
by slot index), and the unbounded cache keeps only frame counts. A window cache's ring writes
whole frames into frame slots, which a sort
would scatter: AnnSA refuses it (AnnCA works with any cache). The re-sort copies one layer's
history K/V once per chunk (the unbounded cache re-hashes and re-sorts its whole history: a
GEMM with ``bits`` columns and one sort, small next to the attention it saves).

With ``method='lsh'``, per step only the chunk's queries are hashed and sorted by bucket
(``q_perm``, so a query block shares buckets); a query block's buckets become a fixed-size
range list on the device (``R = 2 + ceil(2**bits / 2)`` slots, unused ones ignored by
``range_counts``) that ``block_sparse_attention_auto`` reads. Nothing syncs with the
host: every shape comes from Python integers the schedule knows. On CUDA a bucket plan is one
CUDA graph replay (``AnnSA._replay``): its ~40 small kernels cost more to launch than to run
wherever the host, not the GPU, sets the pace.

``method='quant'`` (the default) keeps the same sorted layout but selects differently: at
write time each block of ``KEY_BLOCK`` (128) sorted history keys gets its mean key,
int8-quantized, and its log key multiplicity (TempCache's log m: a merged key stands for m
frames). Per step each query's logits against those means, and against the sink's and the
open chunk's block means, estimate its share of attention mass in every block; averaged over a
query block (64 neighbouring tokens) they rank its history blocks, and it reads the best
``keep_fraction`` of them and more until, with the sink and its own chunk, they hold
``keep_mass`` of its estimated mass (top-p) (``kernels/quant_scores.py``,
``kernels/quant_select.py``; touching blocks fuse into one range). Why top-p, not a fixed
share: a query block whose own neighbourhood holds its attention needs few history blocks, a
diffuse one many; at a fixed share the diffuse layers lose recall while the local ones read
blocks they do not need. Why a floor: a mean key underestimates a block that mixes unlike keys
(Jensen), so the estimate alone can stop early on sharply clustered keys (bench/NOTES.md).
The defaults, floor 0.2 and keep_mass 0.95 (H200, sensitized testbed, bench/NOTES.md): after 81
real frames the end-to-end fidelity run kept 0.949 of the mass where a fixed 0.35 kept 0.919
(PSNR 51.6 against 50.1 dB); on chunks generated from noise, as the benchmarks time them, 0.957
against 0.899, reading more there (1.07x the time of a chunk). On synthetic extremes (CPU,
tests/test_ann.py) the fixed 0.35 keeps 0.50 of diffuse attention and 0.97 of sharply clustered
keys, this setting 0.95 and 0.87. ``keep_mass=0`` is the fixed share alone: the
``keep_fraction`` blocks whose mean scores highest against any of the block's queries.
Why quant is the default: on real-video queries it keeps more of the attention mass
at a given density than buckets do (bench/results/ann_bench*.json). Its query blocks are runs of
consecutive tokens (neighbouring patches of a frame), not LSH buckets: on real-video queries
that kept more of the mass (keep 0.35, 81 cached frames: recall 0.942 against 0.939 with
bucket-sorted queries, bench/results/ann_bench_random.json; likewise at 21 and 240 frames,
bench/NOTES.md), and the plan is then two kernels, with no query hashing, sorting or CUDA graph.

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

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from ..kernels import triton_runs_on
from ..kernels.block_means import block_means_auto
from ..kernels.block_sparse_attention import block_sparse_attention_auto, kernel_supports
from ..kernels.quant_scores import quant_block_scores_auto, quant_block_shares_auto
from ..kernels.quant_select import quant_select_auto, range_reads, runs_to_ranges
from .attention import attend_lse, side_stream
from .errors import FastARError

ANN_METHODS = ("lsh", "quant")
MAX_BITS = 12
# 'quant': history keys per scored block. 128 rather than the kernel's 64-key tile: a pick is then
# two tiles, so a plan has half the ranges (the kernel's pipeline restarts at each), and the sparse
# call, planning included, took 3.8 instead of 4.4 ms at 81 frames for recall 0.939 instead of
# 0.943 (bench/results/ann_bench_random_kb128.json, bench/NOTES.md).
KEY_BLOCK = 128

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
    ``method='quant'`` (default) selects for AnnSA, instead of bucket hits, blocks of 128 sorted
    history keys by int8-quantized similarity to their mean keys: a query block's best
    ``keep_fraction`` of them, and more while they, the sink and the open chunk hold less than
    ``keep_mass`` of its estimated attention mass (``keep_mass=0``: ``keep_fraction`` of them,
    ranked by their best query's logit). AnnCA always uses buckets.
    ``annca`` is off by default: over Wan's 512 prompt tokens dense cross-attention costs ~0.1 ms
    a call on an H200, less than selecting tokens does (bench/results/ann_bench.json)."""
    method: str = "quant"
    bits: int = 8
    probes: int = 2
    block_q: int = 64
    dense_steps_fraction: float = 0.3
    dense_layers: tuple[int, ...] = ()
    annsa: bool = True
    annca: bool = False
    min_tokens: int = 64
    seed: int = 0
    keep_fraction: float = 0.2
    keep_mass: float = 0.95
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
        f = self.keep_mass
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise FastARError(f"AnnConfig.keep_mass must lie in [0, 1] (0: keep_fraction of the blocks only), "
                              f"got {f!r}")
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
    once from ``seed`` on the host (so every device gets the same planes). The methods take one
    layer's planes (``self.planes[layer]``, [H, D, bits]) so a captured plan can be fed any layer's."""

    def __init__(self, bits: int, probes: int, *, num_layers: int, num_heads: int, head_dim: int, seed: int,
                 device):
        g = torch.Generator().manual_seed(seed)
        self.planes = torch.randn(num_layers, num_heads, head_dim, bits, generator=g).to(device)
        self.bits, self.probes = bits, probes
        self.weights = (1 << torch.arange(bits, device=device))

    @staticmethod
    def project(planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, H, D] -> projections [B, H, L, bits] (in x's dtype, fp32 out)."""
        return torch.einsum("blhd,hdk->bhlk", x, planes.to(x.dtype)).float()

    def codes(self, proj: torch.Tensor) -> torch.Tensor:
        """Bucket id of each projection row: the packed sign bits (int64)."""
        return ((proj > 0).long() * self.weights).sum(-1)

    def hash(self, planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Bucket ids [B, H, L] of x [B, L, H, D]."""
        return self.codes(self.project(planes, x))

    def probe_codes(self, planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Buckets each row of x [B, L, H, D] probes: its own, then its code with each of its
        ``probes`` smallest-margin bits flipped. Returns [B, H, L, 1 + probes]."""
        proj = self.project(planes, x)
        code = self.codes(proj)
        if not self.probes:
            return code[..., None]
        flip = proj.abs().topk(self.probes, dim=-1, largest=False).indices  # least certain bits
        return torch.cat([code[..., None], code[..., None] ^ (1 << flip)], dim=-1)


def _int8(x: torch.Tensor):
    """Symmetric int8 quantization per (b, h) of x [B, H, N, D]: (int8 values, fp32 scale)."""
    scale = x.abs().amax((-2, -1), keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _refresh(old, new):
    """``new``, written into ``old``'s tensors when their shapes match: a replayed CUDA graph reads them."""
    if old is not None and all(a.shape == b.shape for a, b in zip(old, new)):
        for a, b in zip(old, new):
            a.copy_(b)
        return old
    return new


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

    graphs = True  # CUDA graphs for bucket plans (``_replay``); False runs them eagerly (to compare)
    # On CUDA the sink and open chunk's cuDNN call runs on a side stream beside the plan's kernels, which are
    # latency-bound and leave most of the GPU idle; False runs it in line (to compare).
    overlap_prior = True

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
        # telemetry, written by every plan (``density``): keys each query block of the layer's last plan reads
        # [B, H, nqb], and the keys that plan's call attends
        self.reads: list = [None] * cache.num_layers
        self.attended: list = [0] * cache.num_layers
        self.reps: list = [None] * cache.num_layers  # 'quant': each layer's ``_block_means``
        self.fixed: list = [None] * cache.num_layers  # 'quant' top-p: ``_fixed_blocks``
        self._graph = None  # CUDA: (signature, graph, static inputs, outputs) of the plan (``_replay``)

    @torch.no_grad()
    def index_history(self, layer: int) -> None:
        """After the clean pass wrote the layer: hash its history, sort it by bucket in place,
        record the bucket offsets. Empty TempCache slots sort last and join no bucket."""
        cache, nb = self.cache, self.config.buckets
        rows = cache.sorted_rows(clean_pass=True)
        code = self.lsh.hash(self.lsh.planes[layer], cache.k[layer, :, rows])       # [B, H, M]
        filled = cache.filled_rows(layer)
        if filled is not None:
            code = torch.where(filled, code, nb)
        perm = torch.argsort(code.to(torch.int16), dim=-1, stable=True)  # ids < 2**13: a 16-bit radix sort
        cache.permute_rows(layer, rows, perm)
        ordered = code.gather(-1, perm)
        edges = torch.arange(nb + 1, device=code.device).expand(*code.shape[:2], nb + 1).contiguous()
        self.offsets[layer] = (rows.start + torch.searchsorted(ordered, edges)).to(torch.int32)
        if self.config.method == "quant":
            bias = cache.log_count_bias[layer, :, :, rows] if cache.has_bias else None
            reps = self._block_means(cache.k[layer, :, rows], ordered < nb, bias)
            self.reps[layer] = _refresh(self.reps[layer], reps)
            sink = cache.sink_rows
            if self.config.keep_mass > 0 and sink:
                # the sink as committed so far: a chunk's own sink frames are committed after this write,
                # so the plans read them one chunk later (until then they count as empty)
                filled = cache.log_count_bias[layer, :, :, :sink] > float("-inf")
                means, counts, ns = self._fixed_blocks(layer, cache.chunk_rows())
                block_means_auto(cache.k[layer, :, :sink], filled, KEY_BLOCK, out=(means[:, :, :ns], counts[:, :, :ns]))

    @staticmethod
    def _block_means(k: torch.Tensor, filled: torch.Tensor, bias: torch.Tensor | None):
        """Per block of KEY_BLOCK history keys k [B, M, H, D] (filled [B, H, M]; ``bias`` the
        keys' TempCache log m [B, H, M] or None), everything a plan reads, made once per write:
        the int8 mean of its filled keys [B, H, nkb, D], the logit of one int8 level [B, H]
        (their fp32 scale over sqrt(D)), the log of its key multiplicity (logsumexp of log m over
        its filled keys, log(count) without TempCache, -inf when empty) [B, H, nkb], and
        whether it holds a key [B, H, nkb]."""
        b, m, h, d = k.shape
        nkb = -(-m // KEY_BLOCK)
        pad = nkb * KEY_BLOCK - m
        mean, _ = block_means_auto(k, filled, KEY_BLOCK)
        log_m = bias.float() if bias is not None else torch.zeros_like(filled, dtype=torch.float32)
        log_m = torch.nn.functional.pad(log_m.masked_fill(~filled, float("-inf")), (0, pad), value=float("-inf"))
        k8, scale = _int8(mean)
        log_mass = log_m.view(b, h, nkb, KEY_BLOCK).logsumexp(-1)
        return k8, scale.view(b, h) / math.sqrt(d), log_mass, log_mass > float("-inf")

    def plan(self, layer: int, q: torch.Tensor):
        """Ranges of each query block of q [B, n, H, D] (the open chunk's queries) over the keys
        ``extend`` returned: (q_perm [B, H, n] or None for the natural order, ranges [B, H, nqb,
        R, 2], range_counts [B, H, nqb]). On CUDA a bucket plan is one CUDA graph replay (see
        ``_replay``): its tensors are the graph's outputs, valid until the next ``plan`` call."""
        cfg, cache = self.config, self.cache
        sink, chunk = cache.sink_rows, cache.chunk_rows()
        fixed = dict(sink=sink, chunk_start=chunk.start, chunk_stop=chunk.stop)
        reads = self._reads(layer, q)
        if cfg.method == "lsh":
            plan = self._replay(("lsh", *fixed.values()), lambda *a: self._lsh_plan(*a, **fixed),
                                (q, self.lsh.planes[layer], self.offsets[layer]))
            reads.copy_(range_reads(plan[1], plan[2]))
        else:
            plan = self._quant_plan(q, self.reps[layer], layer, cache.k[layer, :, chunk],
                                    rows=cache.sorted_rows(clean_pass=False), reads=reads, **fixed)
        self.attended[layer] = cache.attended_rows()
        return plan

    def _reads(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The layer's keys-read buffer for plans over q [B, n, H, D], made anew when the query
        blocks change (a first chunk, a shorter one: op by op, never inside a graph capture), so a
        replayed chunk's plans write into the buffer ``density`` reads."""
        shape = (q.shape[0], q.shape[2], -(-q.shape[1] // self.config.block_q))
        if self.reads[layer] is None or tuple(self.reads[layer].shape) != shape:
            self.reads[layer] = torch.zeros(shape, dtype=torch.int32, device=q.device)
        return self.reads[layer]

    @property
    def density(self) -> torch.Tensor:
        """Keys read / keys attended by each layer's last plan (1 before its first), [num_layers]:
        telemetry from the plans' own output, no kernel in the hot path (the quant selection
        kernel writes each query block's keys read; lsh plans add one reduction)."""
        out = torch.ones(len(self.reads), device=self.cache.device)
        for layer, (reads, keys) in enumerate(zip(self.reads, self.attended)):
            if reads is not None:
                out[layer] = reads.float().mean() / max(keys, 1)
        return out

    def _replay(self, key, fn, inputs):
        """``fn(*inputs)``; on CUDA captured once per signature as a CUDA graph and replayed.

        Why: a plan is ~20-40 small kernels; launched one by one they took 0.7-1.1 ms a call on
        the H200 in isolation, a replay (one launch plus copies of the inputs into the graph's
        buffers) 0.2-0.5 ms. Inside a rollout the GPU is the bottleneck and the host runs
        ahead, so there it gains little (bench/NOTES.md). The signature is every shape and
        Python integer the plan bakes in, so a cache at its budget (TempCache) replays one graph
        all rollout long; only the latest graph is kept (an unbounded cache captures one per
        chunk, replayed by every layer and step)."""
        q = inputs[0]
        if not (self.graphs and q.is_cuda) or torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        key = (*key, *((tuple(t.shape), t.dtype) for t in inputs), q.device)
        if self._graph is None or self._graph[0] != key:
            self._graph = None  # free the old graph's memory before capturing
            static = [t.clone() for t in inputs]
            # Warm-up outside the capture (Triton compiles, cuBLAS initialises) on the current
            # stream: a fresh side stream per capture would get a cuBLAS workspace of its own,
            # kept for the life of the process.
            fn(*static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*static)
            self._graph = (key, graph, static, out)
        _, graph, static, out = self._graph
        for buf, t in zip(static, inputs):
            buf.copy_(t)
        graph.replay()
        return out

    def _lsh_plan(self, q, planes, offsets, *, sink: int, chunk_start: int, chunk_stop: int):
        """The bucket plan: a query block reads the history runs of every bucket its queries
        probe (``offsets`` [B, H, nb + 1]: the layer's sorted bucket bounds)."""
        cfg, nb = self.config, self.config.buckets
        b, n, h, _ = q.shape
        nqb = -(-n // cfg.block_q)
        cands = self.lsh.probe_codes(planes, q)                     # [B, H, n, 1 + probes]
        q_perm = torch.argsort(cands[..., 0].to(torch.int16), dim=-1, stable=True)
        cands = cands.gather(2, q_perm[..., None].expand_as(cands))
        block = torch.arange(n, device=q.device) // cfg.block_q
        hit = _hit_buckets(cands, block, nqb, nb)                   # [B, H, nqb, nb]
        starts, ends = offsets[..., None, :-1], offsets[..., None, 1:]
        sel = hit | (starts == ends)                                # empty buckets bridge runs
        return (q_perm, *runs_to_ranges(sel, starts.expand_as(sel), ends.expand_as(sel), self.max_ranges, sink=sink,
                                        chunk_start=chunk_start, chunk_stop=chunk_stop))

    def _quant_plan(self, q, reps, layer: int, chunk_keys, *, rows: slice, sink: int, chunk_start: int,
                    chunk_stop: int, reads: torch.Tensor):
        """The 'quant' plan: each block of ``block_q`` consecutive queries reads its best
        ``keep_fraction`` key blocks and, beyond them, top-p (``keep_mass``); a key block scores
        the best int8 dot product of its mean key with any of the block's queries (a block mixing
        two clusters of queries keeps both clusters' keys), as a logit, plus the log of its key
        multiplicity (TempCache's merged keys weigh m times) (``kernels/quant_scores.py``); for
        top-p, each query's estimated share of its mass per key block, the sink's and the open
        chunk's blocks counted in, averaged over the block. Picked blocks that touch in the
        sorted history fuse into one range (``kernels/quant_select.py``).
        ``reps``: the layer's ``_block_means`` (None before its first write: the plan is the sink
        and the chunk); ``chunk_keys`` [B, n, H, D]: the open chunk's keys; ``reads`` [B, H, nqb] receives
        each query block's keys read."""
        cfg, bq = self.config, self.config.block_q
        b, n, h, d = q.shape
        if reps is None:
            none = torch.zeros(b, h, -(-n // bq), 0, dtype=torch.int32, device=q.device)
            plan = runs_to_ranges(none.bool(), none, none, 2, sink=sink, chunk_start=chunk_start, chunk_stop=chunk_stop)
            reads.copy_(range_reads(*plan))
            return (None, *plan)
        k8, logit_scale, log_mass, held = reps
        top = math.ceil(cfg.keep_fraction * log_mass.shape[-1])
        qt, spans = q.transpose(1, 2), dict(key_block=KEY_BLOCK, rows_start=rows.start, rows_stop=rows.stop, sink=sink,
                                            chunk_start=chunk_start, chunk_stop=chunk_stop, reads=reads)
        if not cfg.keep_mass:
            score = quant_block_scores_auto(qt, k8, logit_scale, log_mass, bq)
            return (None, *quant_select_auto(score, held, top, **spans))
        means, counts, ns = self._fixed_blocks(layer, slice(chunk_start, chunk_stop))
        block_means_auto(chunk_keys, None, KEY_BLOCK, out=(means[:, :, ns:], counts[:, :, ns:]))
        share, fixed_share = quant_block_shares_auto(qt, k8, logit_scale, log_mass, means, counts, bq)
        return (None, *quant_select_auto(share, held, top, mass=cfg.keep_mass, fixed=fixed_share, **spans))

    def _fixed_blocks(self, layer: int, chunk: slice):
        """The layer's blocks of the keys every plan reads, for top-p: (float means [B, H, ns + nc, D],
        key counts [B, H, ns + nc], ns), the sink's ns blocks (written at index time; empty until then)
        before the open chunk's nc (written per plan). One buffer, so the share kernel reads both
        with no copy; made anew, the sink's part kept, when the chunk's length changes."""
        cache = self.cache
        ns, nc = -(-cache.sink_rows // KEY_BLOCK), -(-(chunk.stop - chunk.start) // KEY_BLOCK)
        old = self.fixed[layer]
        if old is None or old[0].shape[2] != ns + nc:
            shape = (cache.batch, cache.num_heads, ns + nc)
            means = torch.zeros(*shape, cache.head_dim, device=cache.device)
            counts = torch.zeros(shape, device=cache.device)
            if old is not None:
                means[:, :, :ns], counts[:, :, :ns] = old[0][:, :, :ns], old[1][:, :, :ns]
            self.fixed[layer] = (means, counts)
        return (*self.fixed[layer], ns)

    @torch.no_grad()
    def recall(self, q, keys, bias, plan, sample_blocks: int = 4, history_only: bool = False) -> torch.Tensor:
        """Dense attention mass inside ``plan`` (``self.plan``'s result), averaged over the
        queries of ``sample_blocks`` query blocks spread over the chunk (device scalar).
        ``history_only``: the share of the mass on cached keys (all but the open chunk's own,
        which every plan reads) that the plan keeps: the part of recall the selection earns."""
        q_perm, ranges, counts = plan
        b, n, h, d = q.shape
        nqb, bq, lk = ranges.shape[2], self.config.block_q, keys.shape[1]
        n_pick = min(sample_blocks, nqb)
        picks = sorted({round(i * (nqb - 1) / max(n_pick - 1, 1)) for i in range(n_pick)})
        used = torch.arange(ranges.shape[3], device=q.device) < counts[..., None]        # [B, H, nqb, R]
        key = torch.arange(lk, device=q.device)
        chunk = self.cache.chunk_rows()
        cached = ((key < chunk.start) | (key >= chunk.stop)) if history_only else torch.ones_like(key, dtype=torch.bool)
        mass = []
        if q_perm is None:
            q_perm = torch.arange(n, device=q.device).expand(b, h, n)
        for blk in picks:
            rows = q_perm[:, :, blk * bq:(blk + 1) * bq]                                  # [B, H, r]
            r = ranges[:, :, blk]
            inside = ((key >= r[..., 0, None]) & (key < r[..., 1, None]) & used[:, :, blk, :, None]).any(-2)
            for i in range(h):  # one head at a time: [B, r, Lk] logits stay small
                qs = q[:, :, i].gather(1, rows[:, i, :, None].expand(b, rows.shape[-1], d)).float()
                logits = qs @ keys[:, :, i].float().transpose(1, 2) / math.sqrt(d)
                if bias is not None:
                    logits = logits + bias[:, i, None]
                p = logits.softmax(-1) * cached
                mass.append(((p * inside[:, i, None]).sum(-1) / p.sum(-1).clamp_min(1e-30)).flatten())
        return torch.cat(mass).mean()

    def attention(self, layer: int, q, keys, values, bias, plan=None):
        """Sparse self-attention of q [B, n, H, D] over ``extend``'s keys/values [B, Lk, H, D].

        Where the kernel runs and the plan's first two ranges (the sink, the open chunk) are the
        cache's one unbiased span ``fixed_rows``, cuDNN attends that span and the kernel the rest of
        the plan, starting from its softmax (``attend_lse``)."""
        _warn_twin(q)
        prior, side, fixed = None, None, self.cache.fixed_rows()
        if fixed is not None and triton_runs_on(q) and kernel_supports(q, self.config.block_q):
            if self.overlap_prior and q.is_cuda:
                # the side stream waits for this layer's K/V, and waits again before its next call,
                # which orders its reuse of the memory it allocates after the kernel that reads it
                side = side_stream(q.device, "prior")
                side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                prior = attend_lse(q, keys[:, fixed], values[:, fixed])
        q_perm, ranges, counts = plan if plan is not None else self.plan(layer, q)
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
        if prior is not None:
            ranges, counts = ranges[:, :, :, 2:], counts - 2
        out = block_sparse_attention_auto(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                          ranges, counts, key_bias=bias, q_perm=q_perm,
                                          block_q=self.config.block_q, prior=prior,
                                          bias_window=self.cache.bias_window() if bias is not None else None)
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
        cands = self.lsh.probe_codes(self.lsh.planes[layer], q)   # [B, H, n, P]
        hit = _hit_buckets(cands, torch.arange(n, device=q.device) // tpf, frames, self.config.buckets)
        code_k = self.lsh.hash(self.lsh.planes[layer], k)          # [B, H, Lc]
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
    return range_reads(ranges, counts).float().mean() / max(num_keys, 1)


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
