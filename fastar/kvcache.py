"""The KV cache of an autoregressive rollout: one protocol for every caller.

Per layer it holds preallocated K/V buffers ``[B, slots, H, D]``, a per-key log-count bias
(zeros until TempCache merges keys) and the frame index of every slot. A chunk's forwards
run under this protocol, driven by the rollout engine:

    begin_chunk(frame_start, frames)   where the chunk's own K/V will sit (the scratch slots)
    extend(layer, k, v)                every forward: write the chunk's K/V into the scratch
                                       slots (``scratch(layer)``: a model may compute them
                                       there), return views of all attended rows: [history |
                                       own chunk], with TempCache [sink | own chunk | history]
    after_attention(layer, q)          every forward, once the layer has attended
    begin_clean_pass()                 the next forward is the clean pass: it writes history
    commit()                           after the clean pass: the chunk becomes history

Denoising forwards overwrite the scratch without committing, so cached history is written
once, by the clean pass, and never changes afterwards. Keys and values are post-RoPE, so
slot order is irrelevant to attention: the bounded mode is a ring over frame slots, and
TempCache (``fastar.tempcache``) manages its history token by token, merging in
``after_attention`` of the clean pass. TempCache's scratch sits right after the sink, so the
keys every query reads dense and unbiased are one span (``fixed_rows``): one cuDNN call.
Frame bookkeeping is in Python integers known from the schedule, TempCache's on the device:
no host sync per layer. On CUDA the clean pass's history writes may run on a side stream
(``write_stream``, set by ``FastARAttention``); ``join_writes`` (the engine's, before a
chunk's CUDA graph ends) and ``commit`` wait for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.gather_rows import gather_rows_auto
from .errors import FastARError
from .tempcache import TempCache, TempCacheConfig

CACHE_MODES = ("unbounded", "window")


@dataclass(frozen=True)
class CacheConfig:
    """``unbounded`` keeps every frame; ``window`` keeps the first ``sink_frames`` frames and
    the last ``window_frames`` frames before the current chunk (LongLive: sink 3, window 12)."""
    mode: str = "unbounded"
    sink_frames: int = 3
    window_frames: int = 12

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise FastARError(f"unknown cache mode {self.mode!r}; expected one of {', '.join(CACHE_MODES)}")
        if not isinstance(self.sink_frames, int) or self.sink_frames < 0:
            raise FastARError(f"sink_frames must be an integer >= 0, got {self.sink_frames!r}")
        if not isinstance(self.window_frames, int) or self.window_frames < 1:
            raise FastARError(f"window_frames must be an integer >= 1, got {self.window_frames!r}")

    @property
    def bounded(self) -> bool:
        return self.mode == "window"


@dataclass(frozen=True)
class CacheStats:
    frames_cached: int        # frames committed so far (the video generated)
    tokens_held: int          # history tokens attended by the next chunk
    dense_tokens: int         # tokens a dense unbounded cache would hold
    capacity_tokens: int      # slots allocated (history + one chunk of scratch)
    bytes: int                # bytes allocated: K, V, log-count bias and merge state, all layers
    bytes_per_token: int      # K+V bytes of one token over all layers
    merged: int = 0           # TempCache: tokens of the last chunk merged into groups (per layer and head)
    evicted: int = 0          # TempCache: history tokens the last chunk evicted (per layer and head)

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
    """Preallocated K/V of every layer under one policy: ``CacheConfig`` (unbounded or sink +
    window, frame slots) or ``TempCacheConfig`` (sink + a token budget with merging)."""

    def __init__(self, config: CacheConfig | TempCacheConfig, *, num_layers: int, batch: int, num_heads: int,
                 head_dim: int, tokens_per_frame: int, chunk_frames: int, max_frames: int | None = None,
                 device=None, dtype=torch.float32):
        if chunk_frames < 1:
            raise FastARError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.config = config
        self.num_layers, self.batch, self.num_heads, self.head_dim = num_layers, batch, num_heads, head_dim
        self.tokens_per_frame, self.chunk_frames = tokens_per_frame, chunk_frames
        self.device, self.dtype = torch.device(device) if device is not None else torch.device("cpu"), dtype
        temporal = isinstance(config, TempCacheConfig)
        if temporal:
            if config.history_frames < chunk_frames:
                raise FastARError(f"TempCacheConfig.max_cache_frames={config.max_cache_frames} leaves "
                                  f"{config.history_frames} history frames besides {config.sink_frames} sink "
                                  f"frames; at least one chunk ({chunk_frames} frames) is needed")
            capacity = config.max_cache_frames + chunk_frames
        elif config.bounded:
            capacity = config.sink_frames + config.window_frames + chunk_frames
        elif max_frames is not None:
            capacity = max_frames
        else:
            capacity = 4 * chunk_frames
        self.frames_cached = 0
        self.frames_held = 0          # committed frames in frame slots (TempCache: sink frames only)
        self.has_bias = temporal  # TempCache: log m on merged keys, -inf on empty slots
        self._scratch: tuple[int, int] | None = None  # (first slot, frames) of the open chunk
        self._writing = False
        self._spare = 1 if temporal else 0  # TempCache's dump token after the last slot
        self.reallocations = 0
        self.write_stream = None  # a side stream still writing history (FastARAttention's clean pass)
        self._allocate(capacity)
        self.tempcache = None
        if temporal:
            self.tempcache = TempCache(config, num_layers=num_layers, batch=batch, num_heads=num_heads,
                                       history_tokens=config.history_frames * tokens_per_frame,
                                       new_tokens=chunk_frames * tokens_per_frame, device=self.device)
            # frame of each token the open chunk's clean pass merges (a fixed buffer: a chunk's
            # forwards may be replayed from a CUDA graph, which reads it)
            self._new_frames_buf = torch.empty(chunk_frames * tokens_per_frame, dtype=torch.long, device=self.device)
            self.log_count_bias[..., self._tokens(0, config.sink_frames)] = float("-inf")  # empty
            self.log_count_bias[..., self._history_rows()] = float("-inf")

    # -- buffers ---------------------------------------------------------------------------
    def _allocate(self, capacity_frames: int) -> None:
        tokens = capacity_frames * self.tokens_per_frame + self._spare
        shape = (self.num_layers, self.batch, tokens, self.num_heads, self.head_dim)
        try:
            # zeros, not empty: masked (-inf) slots must still hold finite values (0 * NaN = NaN)
            k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            bias = torch.zeros(self.num_layers, self.batch, self.num_heads, tokens, device=self.device)
        except torch.OutOfMemoryError:
            gb = 2 * torch.Size(shape).numel() * torch.empty(0, dtype=self.dtype).element_size() / 1e9
            raise FastARError(f"a KV cache of {capacity_frames} frames needs {gb:.1f} GB and does not fit on "
                              f"{self.device}; use the window cache mode or fewer frames") from None
        slot_frame = [-1] * capacity_frames
        if hasattr(self, "k"):
            n = self.frames_held * self.tokens_per_frame
            k[:, :, :n] = self.k[:, :, :n]
            v[:, :, :n] = self.v[:, :, :n]
            bias[..., :n] = self.log_count_bias[..., :n]
            slot_frame[:self.frames_held] = self.slot_frames[:self.frames_held]
        self.k, self.v, self.log_count_bias, self.slot_frames = k, v, bias, slot_frame

    @property
    def capacity_frames(self) -> int:
        return len(self.slot_frames)

    @property
    def sink_frames(self) -> int:
        cfg = self.config
        return cfg.sink_frames if isinstance(cfg, TempCacheConfig) or cfg.bounded else 0

    def _tokens(self, first_slot: int, frames: int) -> slice:
        return slice(first_slot * self.tokens_per_frame, (first_slot + frames) * self.tokens_per_frame)

    def _sink_frames_in_chunk(self) -> int:
        return max(0, min(self._scratch[1], self.sink_frames - self.frames_cached))

    # -- protocol --------------------------------------------------------------------------
    def begin_chunk(self, frame_start: int, frames: int) -> None:
        """Open the chunk of ``frames`` frames starting at global frame ``frame_start``."""
        if frame_start != self.frames_cached:
            raise FastARError(f"chunks must be generated in order: the cache holds frames up to "
                              f"{self.frames_cached}, the chunk starts at {frame_start}")
        if not 1 <= frames <= self.chunk_frames:
            raise FastARError(f"a chunk has 1..{self.chunk_frames} frames, got {frames}")
        if self.tempcache is not None:
            first = self.config.sink_frames  # scratch between sink and history, always attended whole
        else:
            first = self.frames_held
            if first + frames > self.capacity_frames:  # only unbounded: bounded capacity has room
                self._allocate(max(2 * self.capacity_frames, first + frames))
                self.reallocations += 1
        self._scratch = (first, frames)
        self._writing = False
        if self.tempcache is not None:
            # a short chunk leaves scratch rows between it and the history: empty (-inf) like unfilled slots
            scratch = self.log_count_bias[..., self._tokens(first, self.chunk_frames)]
            scratch.zero_()
            scratch[..., frames * self.tokens_per_frame:] = float("-inf")
            first_new = frame_start + self._sink_frames_in_chunk()
            n = (frame_start + frames - first_new) * self.tokens_per_frame
            self._new_frames = self._new_frames_buf[:n]
            self._new_frames.copy_(torch.arange(first_new, frame_start + frames, device=self.device)
                                   .repeat_interleave(self.tokens_per_frame, output_size=n))

    def scratch(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows where ``extend`` puts the open chunk's K/V of ``layer`` ([B, n, H, D] views):
        a model that computes its K/V into them spares ``extend`` a copy of each."""
        if self._scratch is None:
            raise FastARError("the open chunk's K/V rows (KVCache.extend, .scratch) need an open chunk: "
                              "call begin_chunk first")
        span = self.chunk_rows()
        return self.k[layer, :, span], self.v[layer, :, span]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the open chunk's k/v [B, n, H, D] (unless they are ``scratch``'s views already);
        return (keys, values, key_bias or None)."""
        rows = self.scratch(layer)
        expected = tuple(rows[0].shape)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise FastARError(f"chunk K/V must be {list(expected)}, got {list(k.shape)} / {list(v.shape)}")
        for dst, src in zip(rows, (k, v)):
            if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
                dst.copy_(src)
        stop = self.attended_rows()
        bias = self.log_count_bias[layer, ..., :stop] if self.has_bias else None
        return self.k[layer, :, :stop], self.v[layer, :, :stop], bias

    def begin_clean_pass(self) -> None:
        """The next forward runs on the clean chunk: its K/V become history."""
        if self._scratch is None:
            raise FastARError("KVCache.begin_clean_pass called outside a chunk")
        self._writing = True

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        """In the clean pass, TempCache merges the layer's chunk into history (q [B, n, H, D])."""
        if not (self._writing and self.tempcache is not None):
            return
        first, frames = self._scratch
        new = self._tokens(first + self._sink_frames_in_chunk(), frames - self._sink_frames_in_chunk())
        if new.stop > new.start:
            self.tempcache.write(layer, self.k[layer], self.v[layer], self.log_count_bias[layer], q,
                                 hist=self._history_rows(), new=new, new_frames=self._new_frames,
                                 dump=self.k.shape[2] - 1)

    def join_writes(self) -> None:
        """Make the current stream wait for history writes still running on ``write_stream``."""
        if self.write_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.write_stream)
            self.write_stream = None

    def commit(self) -> None:
        """After the clean pass: the chunk's K/V (as the clean pass wrote them) become history."""
        if self._scratch is None or not self._writing:
            raise FastARError("KVCache.commit needs an open chunk whose clean pass ran (begin_clean_pass)")
        self.join_writes()
        first, frames = self._scratch
        sink, bounded = self.sink_frames, isinstance(self.config, TempCacheConfig) or self.config.bounded
        for i in range(frames):
            g, src = self.frames_cached + i, first + i
            if not bounded or g < sink:
                dst = g if bounded else src
            elif self.tempcache is not None:
                continue  # merged into history by after_attention
            else:
                dst = sink + (g - sink) % self.config.window_frames
            if dst != src:
                s, d = self._tokens(src, 1), self._tokens(dst, 1)
                self.k[:, :, d] = self.k[:, :, s]
                self.v[:, :, d] = self.v[:, :, s]
                self.log_count_bias[..., d] = 0.0 if self.tempcache is not None else self.log_count_bias[..., s]
            self.slot_frames[dst] = g
        self.frames_cached += frames
        if self.tempcache is not None:
            self.frames_held = min(self.frames_cached, sink)
        elif bounded:
            self.frames_held = min(self.frames_cached, sink) + min(max(self.frames_cached - sink, 0),
                                                                   self.config.window_frames)
        else:
            self.frames_held = self.frames_cached
        self._scratch, self._writing = None, False

    def graph_key(self):
        """Everything at Python level that the open chunk's device work depends on (which rows
        its forwards read and write). Two chunks with equal keys launch the same kernels on the
        same buffers, so the second may replay a CUDA graph of the first: from the budget on with
        TempCache, once the window is full with a window cache, never with an unbounded one (its
        history grows)."""
        return (self._scratch, self._sink_frames_in_chunk(), self.frames_held, self.capacity_frames)

    # -- AnnSA's view: which rows are dense, which are bucket-sorted --------------------
    @property
    def clean_pass(self) -> bool:
        """Whether the running forward is the clean pass (its K/V become history)."""
        return self._writing

    @property
    def ann_sortable(self) -> bool:
        """Whether history rows may be reordered: not in a window cache (its ring writes frame slots)."""
        return self.tempcache is not None or not self.config.bounded

    @property
    def sink_rows(self) -> int:
        """Rows [0, sink_rows) are the sink, attended dense."""
        return self.sink_frames * self.tokens_per_frame if self.tempcache is not None else 0

    def chunk_rows(self) -> slice:
        """Rows of the open chunk's own K/V (the scratch), attended dense."""
        return self._tokens(*self._scratch)

    def attended_rows(self) -> int:
        """How many rows the open chunk attends (``extend``'s keys): every slot up to the scratch's
        end, with TempCache up to its history's end."""
        return self._history_rows().stop if self.tempcache is not None else self.chunk_rows().stop

    def _history_rows(self) -> slice:
        """TempCache's history slots, after the sink and the scratch."""
        cfg = self.config
        return self._tokens(cfg.sink_frames + self.chunk_frames, cfg.history_frames)

    def bias_window(self) -> tuple[int, int]:
        """Rows ``[lo, hi)`` outside which every key's bias is 0: TempCache's history after the open
        chunk (with a short chunk's unused scratch rows, which are -inf), and from row 0 until the
        sink is committed (its empty slots are -inf). The committed sink and the open chunk hold
        unmerged keys, so attention may skip the bias there."""
        if self.tempcache is None:
            return 0, self.chunk_rows().start
        fixed = self.fixed_rows()  # the committed sink and the open chunk, before the window
        return (fixed.stop if fixed is not None else 0), self._history_rows().stop

    def fixed_rows(self) -> slice | None:
        """The rows every query reads dense and without a bias (the sink and the open chunk) when
        they are one span, else None: the committed sink and the scratch after it (TempCache), the
        open chunk (other caches: their sink is history like any other frame)."""
        if self._scratch is None:
            return None
        if self.tempcache is None:
            return self.chunk_rows()
        return slice(0, self.chunk_rows().stop) if self.frames_held >= self.sink_frames else None

    def sorted_rows(self, clean_pass: bool) -> slice:
        """History rows AnnSA keeps bucket-sorted: TempCache's history slots; in the unbounded
        cache every committed row, plus, in the clean pass, the chunk about to commit."""
        if self.tempcache is not None:
            return self._history_rows()
        stop = self._tokens(*self._scratch).stop if clean_pass else self.frames_held * self.tokens_per_frame
        return slice(0, stop)

    def filled_rows(self, layer: int) -> torch.Tensor | None:
        """Bool [B, H, M] of ``sorted_rows`` holding a key (TempCache); None where all do."""
        return self.tempcache.count[layer] > 0 if self.tempcache is not None else None

    @torch.no_grad()
    def permute_rows(self, layer: int, rows: slice, perm: torch.Tensor) -> None:
        """Reorder history ``rows`` of a layer per head: new row i takes old row perm[b, h, i].
        Attention is over a key set, so this changes no result; TempCache's slot state follows."""
        for buf in (self.k, self.v):
            part = buf[layer, :, rows]
            part.copy_(gather_rows_auto(part, perm))
        if self.has_bias:
            bias = self.log_count_bias[layer, :, :, rows]
            bias.copy_(bias.gather(-1, perm))
        tc = self.tempcache
        if tc is not None:
            for state in (tc.count[layer], tc.newest[layer], tc.token[layer]):
                state.copy_(state.gather(-1, perm))
            new_slot = torch.empty_like(perm).scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device)
                                                       .expand_as(perm))  # old slot -> new slot
            last = tc.last_slots[layer]
            last.copy_(torch.where(last >= 0, new_slot.gather(-1, last.clamp_min(0)), -1))
            if tc.canon is not None:  # each token's slot per head, as the shared match reads them
                tc.canon[layer].copy_(new_slot.gather(-1, tc.canon[layer]))

    # -- telemetry -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Sizes after the last commit (with TempCache this reads a few device scalars)."""
        per_token = 2 * self.num_layers * self.batch * self.num_heads * self.head_dim * self.k.element_size()
        held, merged, evicted = self.frames_held * self.tokens_per_frame, 0, 0
        nbytes = self.k.nbytes + self.v.nbytes + self.log_count_bias.nbytes
        tc = self.tempcache
        if tc is not None:
            per_head = self.num_layers * self.batch * self.num_heads
            held += round(tc.held_tokens().mean().item())
            merged = round(tc.merged.sum().item() / per_head)
            evicted = round(tc.evicted.sum().item() / per_head)
            nbytes += sum(t.nbytes for t in (tc.count, tc.newest, tc.token, tc.canon) if t is not None)
        return CacheStats(
            frames_cached=self.frames_cached,
            tokens_held=held,
            dense_tokens=self.frames_cached * self.tokens_per_frame,
            capacity_tokens=self.capacity_frames * self.tokens_per_frame,
            bytes=nbytes,
            bytes_per_token=per_token,
            merged=merged,
            evicted=evicted,
        )
