"""What the rollout engine needs of a model and what it reports of a chunk: the ``ChunkModel`` protocol,
``ChunkReport``, the checks of a rollout's geometry and prompt switches, and the noise a chunk starts from."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from .attention import FastARAttention
from .errors import FastARError
from .kvcache import CacheStats

VAE_SCALE = 8  # Wan 2.1 VAE: 8x spatial compression


class ChunkModel(Protocol):
    """What the engine needs of a model: its attention geometry and a chunk forward."""
    num_layers: int
    num_heads: int
    head_dim: int
    latent_channels: int
    context_dim: int  # the width of the rows of a rollout's context (text features, image tokens, actions)
    patch_size: tuple[int, int, int]
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *,
                 frame_offset: int, attention: FastARAttention) -> torch.Tensor: ...

    # Optional: True where a forward syncs nothing with the host and accepts ``frame_offset``
    # as a 0-d tensor, so the engine may replay chunks from a CUDA graph.
    # graph_safe: bool
    # Optional: True where a forward takes ``fill_cache=True`` for the clean pass (see
    # ``Rollout.fill_cache``).
    # fills_cache: bool


@dataclass
class ChunkReport:
    chunk: int
    num_chunks: int
    frames_done: int
    total_frames: int
    latency_s: float
    cache: CacheStats
    latent: torch.Tensor  # the chunk's clean latent [B, C, F, h, w]
    # each layer's AnnSA plan density as this chunk ended (a device tensor: read only when asked)
    annsa_densities: torch.Tensor | None = field(default=None, repr=False)
    prompt: int = 0  # the prompt this chunk was generated with (0: ``context``, i: the i-th switch)
    # the share of AnnSA's layers that ran sparse in this chunk, the rest dense where sparsity did not
    # pay (``AnnSA.review``; None: no AnnSA)
    annsa_sparse: float | None = None

    @cached_property
    def annsa_density(self) -> float | None:
        """Keys AnnSA's plans of this chunk's clean pass read / keys they attend (None: no AnnSA), from
        the report's own snapshot: read when first asked, at any time; a report nobody asks costs no
        host sync."""
        return None if self.annsa_densities is None else self.annsa_densities.mean().item()


def chunk_noise(seed: int, chunk: int, step: int, shape, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Noise for (chunk, step), independent of how many chunks the rollout has. Drawn on the
    device itself: a host-to-device copy would stall the host on every step."""
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + chunk * 7919 + step) % 2**63)
    return torch.randn(shape, generator=g, device=device, out=out)


def latent_grid(model: ChunkModel, height: int, width: int) -> tuple[int, int, int]:
    """Latent height, width and tokens per latent frame for a pixel size (a model's ``vae_scale`` pixels
    to a latent pixel: Wan's VAE's 8 unless it says otherwise)."""
    scale = getattr(model, "vae_scale", VAE_SCALE)
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % (scale * model.patch_size[1]):
            raise FastARError(f"{name}={value} must be a positive multiple of {scale * model.patch_size[1]} pixels")
    h, w = height // scale, width // scale
    return h, w, (h // model.patch_size[1]) * (w // model.patch_size[2])


def check_rollout(model: ChunkModel, context: torch.Tensor, frames: int, height: int, width: int,
                  chunk_frames: int, context_noise: float = 0.0, start: torch.Tensor | None = None
                  ) -> tuple[int, int, int]:
    """Validate a rollout's settings before any work; returns ``latent_grid``."""
    if not isinstance(frames, int) or frames < 1:
        raise FastARError(f"frames must be a positive integer (latent frames), got {frames!r}")
    if not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise FastARError(f"chunk_frames must be a positive integer, got {chunk_frames!r}")
    grid = latent_grid(model, height, width)
    first = 0
    if start is not None:
        first = start.shape[2] if start.ndim == 5 else 0
        want = (model.latent_channels, grid[0], grid[1])
        if start.ndim != 5 or (start.shape[1], *start.shape[3:]) != want or first < 1:
            raise FastARError(f"the start latent must be [B, {want[0]}, frames, {want[1]}, {want[2]}], "
                              f"got {tuple(start.shape)}")
    if first and ((frames - first) % chunk_frames or frames <= first):
        raise FastARError(f"frames={frames} after the start latent's {first} is not a whole number of chunks of "
                          f"chunk_frames={chunk_frames}")
    if not first and frames % chunk_frames:
        raise FastARError(f"frames={frames} is not divisible by chunk_frames={chunk_frames}")
    if context.ndim != 3 or context.shape[-1] != model.context_dim:
        raise FastARError(f"context must be [B, tokens, {model.context_dim}], got {tuple(context.shape)}")
    if start is not None and start.shape[0] != context.shape[0]:
        raise FastARError(f"the start latent's batch {start.shape[0]} must match the context's {context.shape[0]}")
    if not 0 <= context_noise < 1000:
        raise FastARError(f"context_noise must lie in [0, 1000), got {context_noise}")
    return grid


def check_prompts(prompts, context: torch.Tensor, num_chunks: int) -> dict[int, torch.Tensor]:
    """``prompts`` as {chunk: context}: chunks strictly increasing inside the rollout (not the
    first: that is ``context``'s), each context shaped like ``context``."""
    switches, last = {}, 0
    for i, (chunk, text) in enumerate(prompts, 1):
        if not isinstance(chunk, int) or not last < chunk < num_chunks:
            raise FastARError(f"prompt switch {i} is at chunk {chunk!r}; switches must fall strictly after the "
                              f"previous one (chunk {last}) and inside the rollout's {num_chunks} chunks")
        if tuple(text.shape) != tuple(context.shape):
            raise FastARError(f"prompt switch {i}'s context {tuple(text.shape)} must match the first prompt's "
                              f"{tuple(context.shape)}")
        switches[chunk], last = text.to(context), chunk
    return switches
