"""The KV cache of an autoregressive rollout: one protocol for every caller.

Per layer it holds preallocated K/V buffers ``[B, slots, H, D]``, a per-key log-count bias
(zeros until TempCache merges keys) and the frame index of every slot. A chunk's forwards
run under this protocol, driven by the rollout engine:

    begin_chunk(frame_start, frames)   where the chunk's own K/V will sit (the scratch slots)
    extend(layer, k, v)                every forward: write the chunk's K/V into the scratch
                                       slots, return views of [sink | history | own chunk]
    commit()                           after the clean pass: the scratch becomes history

Denoising forwards overwrite the scratch without committing, so cached history is written
once, by the clean pass, and never changes afterwards. Keys and values are post-RoPE, so
slot order is irrelevant to attention: the bounded mode is a ring over frame slots.
All bookkeeping is in Python integers known from the schedule: no host sync per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import FastARError

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
    bytes: int                # bytes allocated: K, V and log-count bias, all layers
    bytes_per_token: int      # K+V bytes of one token over all layers

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
    def __init__(self, config: CacheConfig, *, num_layers: int, batch: int, num_heads: int, head_dim: int,
                 tokens_per_frame: int, chunk_frames: int, max_frames: int | None = None,
                 device=None, dtype=torch.float32):
        if chunk_frames < 1:
            raise FastARError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.config = config
        self.num_layers, self.batch, self.num_heads, self.head_dim = num_layers, batch, num_heads, head_dim
        self.tokens_per_frame, self.chunk_frames = tokens_per_frame, chunk_frames
        self.device, self.dtype = torch.device(device) if device is not None else torch.device("cpu"), dtype
        if config.bounded:
            capacity = config.sink_frames + config.window_frames + chunk_frames
        elif max_frames is not None:
            capacity = max_frames
        else:
            capacity = 4 * chunk_frames
        self.frames_cached = 0
        self.frames_held = 0          # committed frames still in the cache
        self.reallocations = 0
        self.has_bias = [False] * num_layers  # set by TempCache once a layer holds merged keys
        self._scratch: tuple[int, int] | None = None  # (first slot, frames) of the open chunk
        self._allocate(capacity)
        self.reallocations = 0

    # -- buffers ---------------------------------------------------------------------------
    def _allocate(self, capacity_frames: int) -> None:
        tokens = capacity_frames * self.tokens_per_frame
        shape = (self.num_layers, self.batch, tokens, self.num_heads, self.head_dim)
        try:
            k = torch.empty(shape, device=self.device, dtype=self.dtype)
            v = torch.empty(shape, device=self.device, dtype=self.dtype)
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
        self.reallocations += 1

    @property
    def capacity_frames(self) -> int:
        return len(self.slot_frames)

    def slot_frame_tensor(self) -> torch.Tensor:
        """Frame index of every slot (-1: empty or scratch), for consumers on the device."""
        return torch.tensor(self.slot_frames, dtype=torch.long).to(self.device, non_blocking=True)

    def _tokens(self, first_slot: int, frames: int) -> slice:
        return slice(first_slot * self.tokens_per_frame, (first_slot + frames) * self.tokens_per_frame)

    # -- protocol --------------------------------------------------------------------------
    def begin_chunk(self, frame_start: int, frames: int) -> None:
        """Open the chunk of ``frames`` frames starting at global frame ``frame_start``."""
        if frame_start != self.frames_cached:
            raise FastARError(f"chunks must be generated in order: the cache holds frames up to "
                              f"{self.frames_cached}, the chunk starts at {frame_start}")
        if not 1 <= frames <= self.chunk_frames:
            raise FastARError(f"a chunk has 1..{self.chunk_frames} frames, got {frames}")
        first = self.frames_held
        if first + frames > self.capacity_frames:
            if self.config.bounded:  # cannot happen: capacity is sink + window + chunk
                raise FastARError("bounded cache overflow")
            self._allocate(max(2 * self.capacity_frames, first + frames))
        self._scratch = (first, frames)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the open chunk's k/v [B, n, H, D]; return (keys, values, key_bias or None)."""
        if self._scratch is None:
            raise FastARError("KVCache.extend called outside a chunk: call begin_chunk first")
        first, frames = self._scratch
        span = self._tokens(first, frames)
        expected = (self.batch, span.stop - span.start, self.num_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise FastARError(f"chunk K/V must be {list(expected)}, got {list(k.shape)} / {list(v.shape)}")
        self.k[layer, :, span] = k
        self.v[layer, :, span] = v
        bias = self.log_count_bias[layer, ..., :span.stop] if self.has_bias[layer] else None
        return self.k[layer, :, :span.stop], self.v[layer, :, :span.stop], bias

    def commit(self) -> None:
        """The open chunk's K/V (as the clean pass wrote them) become history."""
        if self._scratch is None:
            raise FastARError("KVCache.commit called outside a chunk")
        first, frames = self._scratch
        cfg = self.config
        for i in range(frames):
            g, src = self.frames_cached + i, first + i
            if not cfg.bounded or g < cfg.sink_frames:
                dst = src if not cfg.bounded else g
            else:
                dst = cfg.sink_frames + (g - cfg.sink_frames) % cfg.window_frames
            if dst != src:
                s, d = self._tokens(src, 1), self._tokens(dst, 1)
                self.k[:, :, d] = self.k[:, :, s]
                self.v[:, :, d] = self.v[:, :, s]
                self.log_count_bias[..., d] = self.log_count_bias[..., s]
            self.slot_frames[dst] = g
        self.frames_cached += frames
        if cfg.bounded:
            self.frames_held = (min(self.frames_cached, cfg.sink_frames)
                                + min(max(self.frames_cached - cfg.sink_frames, 0), cfg.window_frames))
        else:
            self.frames_held = self.frames_cached
        self._scratch = None

    # -- telemetry -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        per_token = 2 * self.num_layers * self.batch * self.num_heads * self.head_dim * self.k.element_size()
        return CacheStats(
            frames_cached=self.frames_cached,
            tokens_held=self.frames_held * self.tokens_per_frame,
            dense_tokens=self.frames_cached * self.tokens_per_frame,
            capacity_tokens=self.capacity_frames * self.tokens_per_frame,
            bytes=self.k.nbytes + self.v.nbytes + self.log_count_bias.nbytes,
            bytes_per_token=per_token,
        )
