"""AnnSA: approximate-nearest-neighbour sparse self-attention (FAST-AR §5.3, §6.1).

Cached history never changes after the clean pass writes it, so each layer's history is hashed
(``fastar.lsh``) and *physically* bucket-sorted once per chunk, right after the clean pass wrote
it (``AnnSA.index_history``): K, V, TempCache's key bias and its slot state are permuted per head
in place (``KVCache.held_keys``, ``KVCache.sort_history``). Why physical order, not index lists: the block-sparse kernel
streams contiguous key *ranges*; sorted, keys alike sit in the same blocks, a picked block is one
range and touching picks fuse. Attention is a sum over a key *set*, so slot order never changes
a dense result. A window cache's ring writes whole frames into frame slots, which a sort would
scatter: AnnSA refuses it.

At write time each block of ``KEY_BLOCK`` sorted history keys gets its mean key, int8-quantized,
and its log key multiplicity (TempCache's log m: a merged key stands for m frames). Per step each
query's logits against those means, and against the sink's and the open chunk's block means,
estimate its share of attention mass in every block; averaged over a query block (``block_q``
neighbouring tokens) they rank its history blocks, and it reads the best ``keep_fraction`` of
them and more until, with the sink and its own chunk, they hold ``keep_mass`` of its estimated
mass (top-p) (``kernels/quant_block_shares.py``, ``kernels/quant_select.py``). Why top-p, not a fixed
share: a query block whose own neighbourhood holds its attention needs few history blocks, a
diffuse one many. Why a floor: a mean key underestimates a block that mixes unlike keys (Jensen),
so the estimate alone can stop early on sharply clustered keys. The plan is two
kernels, nothing syncs with the host: every shape comes from Python integers the schedule knows.
Where a kernel runs (``fastar.backend``), cuDNN attends the keys every plan reads (``Layout.fixed``: the
sink and the open chunk) on a side stream, beside the plan's kernels, and the kernel starts from that
softmax; on FlashAttention-4 its block sparsity reads the plan's history, joined to that softmax.
"""
from __future__ import annotations

import math

import torch

from ..kernels.block_means import block_means_auto
from ..kernels.quant_block_scores import quant_block_scores_auto
from ..kernels.quant_block_shares import quant_block_shares_auto
from ..kernels.plan import range_reads, runs_to_ranges
from ..kernels.quant_select import quant_select_auto
from .config import AnnConfig, check_settings
from .lsh import LSH

# History keys per scored block. 128 rather than the kernel's 64-key tile: a pick is then two
# tiles, so a plan has half the ranges (the kernel's pipeline restarts at each), for a little
# less recall.
KEY_BLOCK = 128
#: Plan density (keys read / keys attended) past which a layer's sparse call costs more than the
#: dense one it replaces, planning included: at TempCache's budgets the sparse call's rate is then the
#: dense call's, and planning is the loss. A layer past it runs dense for the rest of the rollout and
#: stops planning and sorting: a layer kept on probation would pay for its plans and its sort every
#: chunk. A prompt switch, which makes a new AnnSA, gives every layer a fresh start.
DENSE_ABOVE = 0.8
#: History rows per row every call reads dense (the sink and the open chunk) below which no density
#: pays: the prior's call over those rows, the join and the plan then cost more than the history's
#: skipped blocks save.
MIN_HISTORY_RATIO = 2.0


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


class AnnSA:
    """Bucket-sorted history of a KV cache and the per-step block plans over it."""

    def __init__(self, config: AnnConfig, cache, lsh: LSH):
        check_settings(cache.config, config, cache.chunk_frames)
        self.config, self.cache, self.lsh = config, cache, lsh
        # telemetry, written by every plan (``density``): keys each query block of the layer's last plan reads
        # [B, H, nqb], and the keys that plan's call attends
        self.reads: list = [None] * cache.num_layers
        self.attended: list = [0] * cache.num_layers
        self.reps: list = [None] * cache.num_layers   # each layer's ``_block_means``
        self.fixed: list = [None] * cache.num_layers  # top-p: ``_fixed_blocks``
        # whether each layer's sparse call pays (``review``); a layer where it does not runs dense, and
        # neither plans nor sorts any more
        self.pays: list = [True] * cache.num_layers
        # whether the history can ever be long enough for a sparse call to pay (``worth``): where it
        # cannot, no layer sorts its history
        reach = cache.config.history_frames
        self.can_pay = reach is None or cache.config.sink_frames + reach >= self.least_budget()
        self._review = None  # the last chunk's densities: (their host copy, its CUDA event or None)
        # observer(layer, q, keys, bias, plan): sees every sparse call's plan as it runs (a measurement's
        # hook: reading its results on the host, it rules out replaying the chunk from a CUDA graph)
        self.observer = None

    @torch.no_grad()
    def index_history(self, layer: int) -> None:
        """After the clean pass wrote the layer: hash its history, sort it by bucket in place and
        make the key blocks' means. Empty TempCache slots sort last."""
        cache, nb, layout = self.cache, self.config.buckets, self.cache.layout
        keys, filled, _ = cache.held_keys(layer, layout.resort)
        code = self.lsh.hash(self.lsh.planes[layer], keys)                             # [B, H, M]
        if filled is not None:
            code = torch.where(filled, code, nb)
        perm = torch.argsort(code.to(torch.int16), dim=-1, stable=True)  # ids < 2**13: a 16-bit radix sort
        cache.sort_history(layer, perm)
        keys, _, log_m = cache.held_keys(layer, layout.resort)
        reps = self._block_means(keys, code.gather(-1, perm) < nb, log_m)
        self.reps[layer] = _refresh(self.reps[layer], reps)
        sink = layout.sink
        if self.config.keep_mass > 0 and sink:
            # the sink as committed so far: a chunk's own sink frames are committed after this write,
            # so the plans read them one chunk later (until then they count as empty)
            keys, filled, _ = cache.held_keys(layer, slice(0, sink))
            means, counts, ns = self._fixed_blocks(layer, sink, layout.chunk)
            block_means_auto(keys, filled, KEY_BLOCK, out=(means[:, :, :ns], counts[:, :, :ns]))

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
        ``attend`` returned: (ranges [B, H, nqb, R, 2], range_counts [B, H, nqb])."""
        layout = self.cache.layout
        chunk = layout.chunk
        plan = self._quant_plan(q, self.reps[layer], layer, self.cache.held_keys(layer, chunk)[0], rows=layout.history,
                                sink=layout.sink, chunk_start=chunk.start, chunk_stop=chunk.stop,
                                reads=self._reads(layer, q))
        self.attended[layer] = layout.attended
        return plan

    @property
    def worth(self) -> bool:
        """Whether the open chunk's history is long enough, against the rows every call reads dense,
        for a sparse call to pay at some density (``MIN_HISTORY_RATIO``): a Python decision from the
        layout, so a chunk graph's key holds it."""
        layout = self.cache.layout
        if layout is None or not self.can_pay:  # between chunks, or never long enough
            return False
        history = layout.history.stop - layout.history.start
        return history >= MIN_HISTORY_RATIO * (layout.attended - history)

    def least_budget(self) -> int:
        """The least TempCache budget (``max_cache_frames``, sink included) under which AnnSA can pay."""
        fixed = self.cache.config.sink_frames + self.cache.chunk_frames
        return self.cache.config.sink_frames + math.ceil(MIN_HISTORY_RATIO * fixed)

    def runs(self, layer: int) -> bool:
        """Whether the layer's sparse steps run sparse in the open chunk."""
        return self.pays[layer] and self.worth

    def graph_key(self):
        """What decides the open chunk's kernels besides the cache's layout: the layers written so far
        (a layer's first plan over history has no key blocks yet), those whose sparse calls pay, and
        whether the history is long enough for any to (``worth``)."""
        return tuple(r is None for r in self.reps), tuple(self.pays), self.worth

    @property
    def sparse_share(self) -> float:
        """The share of the layers AnnSA may run (not ``dense_layers``) that run sparse in the open chunk."""
        layers = [i for i in range(len(self.pays)) if i not in self.config.dense_layers]
        return sum(self.runs(i) for i in layers) / max(len(layers), 1)

    def indexes(self, layer: int) -> bool:
        """Whether the clean pass sorts and indexes the layer's history for later plans."""
        return self.pays[layer] and self.can_pay

    def review(self, average=None) -> torch.Tensor:
        """After a chunk: which layers' sparse calls pay (``pays``), from their plans' densities one
        chunk earlier; returns this chunk's densities [num_layers] (a device tensor, the chunk's
        report's). The densities are copied to the host as this chunk's work ends, without a sync, and
        read at the next review (waiting, if need be, for that chunk's end): the decisions are the same
        however far the host runs ahead, and the host runs at most a chunk ahead.
        ``average``: where this AnnSA holds part of the heads (head parallelism), the densities'
        mean over the ranks, so every rank decides as one process does."""
        pending = self._review
        if pending is not None:
            host, event = pending
            if event is not None:
                event.synchronize()
            self._decide(host.tolist())
        density = self.density if average is None else average(self.density)
        if density.is_cuda:
            host = torch.empty(density.shape, dtype=density.dtype, pin_memory=True)
            host.copy_(density, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._review = (host, event)
        else:
            self._review = (density, None)
        return density

    def _decide(self, densities: list[float]) -> None:
        for layer, d in enumerate(densities):
            if self.reads[layer] is not None and d > DENSE_ABOVE:  # a layer that has planned, too densely
                self.pays[layer] = False

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
        """Keys read / keys attended by each layer's last plan (1 before its first and once it runs
        dense), [num_layers]: telemetry from the plans' own output, no kernel in the hot path (the
        selection kernel writes each query block's keys read)."""
        out = torch.ones(len(self.reads), device=self.cache.device)
        for layer, (reads, keys) in enumerate(zip(self.reads, self.attended)):
            if reads is not None and self.pays[layer]:  # a layer turned dense reads every key
                out[layer] = reads.float().mean() / max(keys, 1)
        return out

    def _quant_plan(self, q, reps, layer: int, chunk_keys, *, rows: slice, sink: int, chunk_start: int,
                    chunk_stop: int, reads: torch.Tensor):
        """The 'quant' plan: each block of ``block_q`` consecutive queries reads its best
        ``keep_fraction`` key blocks and, beyond them, top-p (``keep_mass``); a key block scores
        the best int8 dot product of its mean key with any of the block's queries (a block mixing
        two clusters of queries keeps both clusters' keys), as a logit, plus the log of its key
        multiplicity (TempCache's merged keys weigh m times) (``kernels/quant_block_scores.py``, ``_shares.py``); for
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
            return plan
        k8, logit_scale, log_mass, held = reps
        top = math.ceil(cfg.keep_fraction * log_mass.shape[-1])
        qt, spans = q.transpose(1, 2), dict(key_block=KEY_BLOCK, rows_start=rows.start, rows_stop=rows.stop, sink=sink,
                                            chunk_start=chunk_start, chunk_stop=chunk_stop, reads=reads)
        if not cfg.keep_mass:
            score = quant_block_scores_auto(qt, k8, logit_scale, log_mass, bq)
            return quant_select_auto(score, held, top, **spans)
        means, counts, ns = self._fixed_blocks(layer, sink, slice(chunk_start, chunk_stop))
        block_means_auto(chunk_keys, None, KEY_BLOCK, out=(means[:, :, ns:], counts[:, :, ns:]))
        share, fixed_share = quant_block_shares_auto(qt, k8, logit_scale, log_mass, means, counts, bq)
        return quant_select_auto(share, held, top, mass=cfg.keep_mass, fixed=fixed_share, **spans)

    def _fixed_blocks(self, layer: int, sink: int, chunk: slice):
        """The layer's blocks of the keys every plan reads, for top-p: (float means [B, H, ns + nc, D],
        key counts [B, H, ns + nc], ns), the sink's ns blocks (written at index time; empty until then)
        before the open chunk's nc (written per plan). One buffer, so the share kernel reads both
        with no copy; made anew, the sink's part kept, when the chunk's length changes."""
        cache = self.cache
        ns, nc = -(-sink // KEY_BLOCK), -(-(chunk.stop - chunk.start) // KEY_BLOCK)
        old = self.fixed[layer]
        if old is None or old[0].shape[2] != ns + nc:
            shape = (cache.batch, cache.num_heads, ns + nc)
            means = torch.zeros(*shape, cache.head_dim, device=cache.device)
            counts = torch.zeros(shape, device=cache.device)
            if old is not None:
                means[:, :, :ns], counts[:, :, :ns] = old[0][:, :, :ns], old[1][:, :, :ns]
            self.fixed[layer] = (means, counts)
        return (*self.fixed[layer], ns)

    def attention(self, layer: int, q, keys, values, bias, plan=None):
        """Sparse self-attention of q [B, n, H, D] over ``attend``'s keys/values [B, Lk, H, D] on the cache's
        attention backend: the prior softmax over the keys every plan reads starts (beside the plan, on
        CUDA) before the plan is made."""
        layout, backend = self.cache.layout, self.cache.backend
        prior = backend.start_prior(q, keys, values, layout.fixed, self.config.block_q) if layout.fixed is not None \
            else None
        ranges, counts = plan if plan is not None else self.plan(layer, q)
        if self.observer is not None:
            self.observer(layer, q, keys, bias, (ranges, counts))
        return backend.sparse(q, keys, values, ranges, counts, block_q=self.config.block_q, key_bias=bias,
                              window=layout.bias, prior=prior, layout=layout, key_block=KEY_BLOCK)
