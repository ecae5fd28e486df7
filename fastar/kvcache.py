"""The KV cache of an autoregressive rollout: one protocol, every policy.

Per layer a cache holds preallocated K/V buffers ``[B, rows, H, D]`` (token rows; keys are
post-RoPE, so row order never changes attention). A chunk's forwards run under this protocol,
driven by the rollout engine:

    begin_chunk(frame_start, frames) -> Layout   the chunk's spans, fixed until commit
    rows(layer)                 where a forward writes the chunk's K/V (a model may compute them there)
    attend(layer, k, v)         the K/V (and TempCache's key bias) a call attends: rows [0, attended)
    begin_clean_pass()          the next forward is the clean pass: its K/V become history
                                (``FastARAttention.begin_clean_pass``, which also moves its step)
    write_history(layer, q)     in the clean pass, once the layer has attended (TempCache merges)
    commit()                    the chunk becomes history
    stats(), graph_key()

Denoising forwards overwrite the chunk's rows without committing, so history is written once,
by the clean pass, and never changes afterwards. Frame bookkeeping is in Python integers known
from the schedule (TempCache's slot state lives on the device): no host sync per layer. On CUDA
the clean pass's history writes may run on a side stream (``write_aside``, which
``FastARAttention`` calls; the cache alone holds that stream); ``join_writes`` (the engine's, before a chunk's CUDA graph ends) and
``commit`` wait for them. The keys live where the cache's attention backend (``fastar.backend``) reads
them: its ``new_keys``.

The frame caches live here: ``unbounded`` (every frame, one slot each) and ``window`` (sink +
a ring of frame slots). TempCache, a token budget with merging, is ``fastar.tempcache``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backend as backends
from .config import CacheConfig
from .errors import FastARError


@dataclass(frozen=True)
class Layout:
    """The open chunk's spans in token rows, as the attention calls read them."""
    chunk: slice                   # the chunk's own K/V, attended dense
    attended: int                  # every call attends rows [0, attended)
    sink: int                      # rows [0, sink): a sink every query reads dense (0: the sink is history)
    history: slice                 # the rows a sparse plan selects among
    fixed: slice | None            # the rows every query reads dense and unbiased, when they are one span
    bias: tuple[int, int] | None   # keys [lo, hi) carry a log-count bias, every other's is 0; None: no bias
    resort: slice | None           # rows AnnSA may bucket-sort after the clean pass; None: order is fixed

    def __hash__(self):  # slices hash only from Python 3.12 on
        return hash(tuple((f.start, f.stop) if isinstance(f, slice) else f for f in vars(self).values()))


@dataclass(frozen=True)
class CacheStats:
    frames_cached: int        # frames committed so far (the video generated)
    tokens_held: int          # history tokens attended by the next chunk
    dense_tokens: int         # tokens a dense unbounded cache would hold
    capacity_tokens: int      # rows allocated (history + one chunk)
    bytes: int                # bytes allocated: K, V, key bias and merge state, all layers
    bytes_per_token: int      # K+V bytes of one token over all layers
    merged: int = 0           # TempCache: tokens of the last chunk merged into groups (per layer and head)
    evicted: int = 0          # TempCache: history tokens the last chunk evicted (per layer and head)
    recalled: int = 0         # the memory tier: tokens of archived frames read back (in tokens_held)
    host_bytes: int = 0       # the memory tier: host bytes of the archive (every frame past the sink)

    @property
    def gb(self) -> float:
        """GB allocated (what the device must hold)."""
        return self.bytes / 1e9

    @property
    def held_gb(self) -> float:
        """GB of the history tokens the next chunk attends."""
        return self.tokens_held * self.bytes_per_token / 1e9

    @property
    def dense_gb(self) -> float:
        return self.dense_tokens * self.bytes_per_token / 1e9


class KVCache:
    """The protocol and the fixed buffers every policy shares; subclasses say where rows go."""

    has_bias = False        # a per-key log-count bias (TempCache's log m) exists
    writes_history = False  # ``write_history`` does device work (the engine may overlap it)

    def __init__(self, config, *, num_layers: int, batch: int, num_heads: int, head_dim: int,
                 tokens_per_frame: int, chunk_frames: int, capacity_frames: int, spare_tokens: int = 0,
                 device=None, dtype=torch.float32, backend=None):
        if chunk_frames < 1:
            raise FastARError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.config = config
        self.num_layers, self.batch, self.num_heads, self.head_dim = num_layers, batch, num_heads, head_dim
        self.tokens_per_frame, self.chunk_frames = tokens_per_frame, chunk_frames
        self.device, self.dtype = torch.device(device) if device is not None else torch.device("cpu"), dtype
        self.capacity_frames = capacity_frames
        tokens = capacity_frames * tokens_per_frame + spare_tokens
        shape = (num_layers, batch, tokens, num_heads, head_dim)
        # the attention backend the cache's calls run on, and the keeper of its keys: chosen once here
        self.backend = backend if backend is not None else backends.choose(self.device, dtype, head_dim)
        try:
            self.k = self.backend.new_keys(shape, chunk_tokens=chunk_frames * tokens_per_frame, biased=self.has_bias,
                                           dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, device=self.device, dtype=dtype)  # zeros: a masked row's value is finite
            self.log_count_bias = (torch.zeros(num_layers, batch, num_heads, tokens, device=self.device)
                                   if self.has_bias else None)
        except torch.OutOfMemoryError:
            gb = 2 * torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() / 1e9
            raise FastARError(f"a KV cache of {capacity_frames} frames needs {gb:.1f} GB and does not fit on "
                              f"{self.device}; use the window cache mode or fewer frames") from None
        self.frames_cached = 0    # frames committed so far
        self.frames_held = 0      # committed frames in frame slots (TempCache: sink frames only)
        self._skipped = 0         # frames passed without being cached (``skip_to``)
        self.layout: Layout | None = None
        self._open: tuple[int, int] | None = None  # (first frame slot, frames) of the open chunk
        self._writing = False
        self.write_stream = None  # the side stream still writing history (``write_aside``), until ``join_writes``

    @property
    def sortable(self) -> bool:
        """Whether the history rows may be reordered (AnnSA's sort): as the config says."""
        return self.config.sortable

    def _rows(self, first_slot: int, frames: int) -> slice:
        return slice(first_slot * self.tokens_per_frame, (first_slot + frames) * self.tokens_per_frame)

    # -- protocol --------------------------------------------------------------------------
    def begin_chunk(self, frame_start: int, frames: int) -> Layout:
        """Open the chunk of ``frames`` frames starting at global frame ``frame_start``."""
        if frame_start != self.frames_cached:
            raise FastARError(f"chunks must be generated in order: the cache holds frames up to "
                              f"{self.frames_cached}, the chunk starts at {frame_start}")
        if not 1 <= frames <= self.chunk_frames:
            raise FastARError(f"a chunk has 1..{self.chunk_frames} frames, got {frames}")
        self._writing = False
        self.layout = self._begin(frames)
        return self.layout

    def skip_to(self, frame: int) -> None:
        """Count the frames before ``frame`` as passed without caching them: a bounded cache re-encoding
        only the frames it would still hold (``Rollout.switch_prompt``). The sink must be whole; the
        later frames are what the cache's own policy would have dropped or merged by now."""
        if self.config.history_frames is None:
            raise FastARError("an unbounded cache holds every frame: it cannot skip any")
        if self.layout is not None:
            raise FastARError("KVCache.skip_to inside a chunk")
        if frame < self.frames_cached or self.frames_cached < self.config.sink_frames:
            raise FastARError(f"a cache holding {self.frames_cached} frames (sink {self.config.sink_frames}) "
                              f"cannot skip to frame {frame}")
        self._skipped += frame - self.frames_cached
        self.frames_cached = frame
        self.frames_held = self._held(frame)

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows where ``attend`` puts the open chunk's K/V of ``layer`` ([B, n, H, D] views):
        a model that computes its K/V into them spares ``attend`` a copy of each."""
        if self.layout is None:
            raise FastARError("the open chunk's K/V rows (KVCache.attend, .rows) need an open chunk: "
                              "call begin_chunk first")
        span = self.layout.chunk
        return self.k[layer, :, span], self.v[layer, :, span]

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the open chunk's k/v [B, n, H, D] (unless they are ``rows``' views already);
        return (keys, values, key_bias or None) of every row the chunk attends."""
        rows = self.rows(layer)
        expected = tuple(rows[0].shape)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise FastARError(f"chunk K/V must be {list(expected)}, got {list(k.shape)} / {list(v.shape)}")
        for dst, src in zip(rows, (k, v)):
            if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
                dst.copy_(src)
        stop = self.layout.attended
        bias = self.log_count_bias[layer, ..., :stop] if self.has_bias else None
        return self.k[layer, :, :stop], self.v[layer, :, :stop], bias

    def begin_clean_pass(self) -> None:
        """The next forward runs on the clean chunk: its K/V become history."""
        if self.layout is None:
            raise FastARError("KVCache.begin_clean_pass called outside a chunk")
        self._writing = True

    @property
    def clean_pass(self) -> bool:
        """Whether the running forward is the clean pass."""
        return self._writing

    def write_history(self, layer: int, q: torch.Tensor) -> None:
        """The clean pass's history write of one layer, once it has attended (q [B, n, H, D]).
        Frame caches write whole frames at ``commit``."""

    def write_aside(self, write, q: torch.Tensor) -> None:
        """Run ``write()`` (a layer's history writes) on the side stream, after the work queued so far (the
        layer's K/V of this pass); ``join_writes`` ends it. ``q``, the only per-call tensor the writes may
        read, is kept alive for that stream."""
        side = self.backend.side_stream(q.device, "writes")
        side.wait_stream(torch.cuda.current_stream(q.device))
        q.record_stream(side)
        self.write_stream = side
        with torch.cuda.stream(side):
            write()

    def join_writes(self) -> None:
        """Make the current stream wait for history writes still running on ``write_stream``."""
        if self.write_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.write_stream)
            self.write_stream = None

    def commit(self) -> None:
        """After the clean pass: the chunk's K/V (as the clean pass wrote them) become history."""
        if self.layout is None or not self._writing:
            raise FastARError("KVCache.commit needs an open chunk whose clean pass ran (begin_clean_pass)")
        self.join_writes()
        first, frames = self._open
        for i in range(frames):
            dst = self.frame_slot(self.frames_cached + i)
            if dst is not None and dst != first + i:
                s, d = self._rows(first + i, 1), self._rows(dst, 1)
                self.k[:, :, d] = self.k[:, :, s]
                self.v[:, :, d] = self.v[:, :, s]
                if self.has_bias:
                    self.log_count_bias[..., d] = 0.0
        self.frames_cached += frames
        self.frames_held = self._held(self.frames_cached)
        self.layout, self._open, self._writing = None, None, False

    def graph_key(self):
        """Everything at Python level the open chunk's device work depends on. Two chunks with
        equal keys launch the same kernels on the same buffers, so the second may replay a CUDA
        graph of the first: from the budget on with TempCache, once the window is full with a
        window cache, never with an unbounded one (its history grows)."""
        return self.layout, self.frames_held

    def held_keys(self, layer: int, rows: slice):
        """A layer's keys in ``rows`` [B, M, H, D] with which of them hold a key [B, H, M] and their log
        multiplicity [B, H, M] (both None where every row holds one key: no bias): what AnnSA hashes, sorts
        and summarizes."""
        keys = self.k[layer, :, rows]
        if not self.has_bias:
            return keys, None, None
        log_m = self.log_count_bias[layer, :, :, rows]
        return keys, log_m > float("-inf"), log_m

    @torch.no_grad()
    def sort_history(self, layer: int, perm: torch.Tensor) -> None:
        """Reorder the layout's ``resort`` rows of a layer per head: new row i takes old row perm[b, h, i].
        Attention is over a key set, so this changes no result."""
        rows = self.layout.resort
        if rows is None:
            raise FastARError("this cache's rows keep their order (its layout has no resort span)")
        for buf in (self.k, self.v):
            part = buf[layer, :, rows]
            part.copy_(self.backend.gather_rows(part, perm))
        if self.has_bias:
            bias = self.log_count_bias[layer, :, :, rows]
            bias.copy_(bias.gather(-1, perm))

    def stats(self) -> CacheStats:
        """Sizes after the last commit."""
        return CacheStats(
            frames_cached=self.frames_cached,
            tokens_held=self.frames_held * self.tokens_per_frame,
            dense_tokens=self.frames_cached * self.tokens_per_frame,
            capacity_tokens=self.capacity_frames * self.tokens_per_frame,
            bytes=sum(t.untyped_storage().nbytes() for t in (self.k, self.v, self.log_count_bias) if t is not None)
            + self.backend.storage_bytes,
            bytes_per_token=2 * self.num_layers * self.batch * self.num_heads * self.head_dim * self.k.element_size(),
        )

    # -- what a policy says ----------------------------------------------------------------
    def _begin(self, frames: int) -> Layout:
        """Where the chunk's rows go; sets ``_open``."""
        raise NotImplementedError

    def frame_slot(self, frame: int) -> int | None:
        """The frame slot a committed frame ends in (None: it lives on elsewhere, merged); a ring's slot
        is its latest frame's."""
        raise NotImplementedError

    def _held(self, frames_cached: int) -> int:
        """Committed frames in frame slots after ``frames_cached`` frames."""
        raise NotImplementedError


class FrameCache(KVCache):
    """Whole frames in frame slots: ``unbounded`` (every frame of the rollout) or ``window`` (the
    first ``sink_frames`` frames and a ring of the last ``window_frames``)."""

    def __init__(self, config: CacheConfig, *, max_frames: int | None = None, **geometry):
        if config.bounded:
            capacity = config.sink_frames + config.window_frames + geometry["chunk_frames"]
        elif max_frames is None:
            raise FastARError("the unbounded cache holds every frame: give it max_frames")
        else:
            capacity = max_frames
        super().__init__(config, capacity_frames=capacity, **geometry)

    def _begin(self, frames: int) -> Layout:
        first = self.frames_held
        if first + frames > self.capacity_frames:
            raise FastARError(f"the cache holds {self.capacity_frames} frames; a chunk of {frames} after "
                              f"{first} does not fit")
        self._open = (first, frames)
        chunk = self._rows(first, frames)
        return Layout(chunk=chunk, attended=chunk.stop, sink=0, history=slice(0, chunk.start), fixed=chunk,
                      bias=None, resort=slice(0, chunk.stop) if self.sortable else None)

    def frame_slot(self, frame: int) -> int:
        cfg = self.config
        if not cfg.bounded or frame < cfg.sink_frames:
            return frame
        return cfg.sink_frames + (frame - cfg.sink_frames - self._skipped) % cfg.window_frames  # the ring, in write order

    def _held(self, frames_cached: int) -> int:
        cfg = self.config
        if not cfg.bounded:
            return frames_cached
        sink = min(frames_cached, cfg.sink_frames)
        return sink + min(frames_cached - sink - self._skipped, cfg.window_frames)

