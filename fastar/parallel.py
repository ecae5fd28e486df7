"""Head parallelism (DeepSpeed-Ulysses) of a rollout over several processes: torch.distributed.

Every rank of a process group runs the same rollout (same noise, same text) and holds
``num_heads / world`` heads of every layer's KV cache, so the cache (the part of memory that grows
with the video, or TempCache's budget) takes ``1 / world`` of a GPU per rank. In the model's forward
each rank computes its share of every latent frame's tokens (``shard_tokens``: a contiguous
``1 / world`` of each frame, so per-frame modulation and RoPE stay per token); around self-attention
one all-to-all turns the rank's tokens x all heads of q, k and v into all the chunk's tokens x its
heads (``to_heads``), attention, TempCache and AnnSA run on those heads, and one all-to-all brings
the output back to the rank's tokens (``to_tokens``); the model's output is gathered at the end
(``gather_tokens``). Cross-attention runs on each rank's tokens with every head against the
replicated text K/V: no traffic (AnnCA, which selects prompt tokens per whole frame, is refused).

TempCache's match is over whole tokens (the cosine of all heads concatenated), which no rank holds:
``HeadParallelTempCache`` all-reduces the partial sums instead of keys: each cached token's squared
norm over the rank's heads, then each new token's dot products with the cached tokens at unit norm,
then the matched pairs' three cosine sums. Every rank then takes the same decisions, those one process
takes (up to the order of a sum: near-ties may break another way), and merges the same tokens.
Per layer and chunk that is N x M scores for N new and M cached tokens (in the keys' dtype), the price of
deciding on whole tokens without moving keys. AnnSA's plans are per head: each rank plans its own heads
with the LSH planes one process draws for them; nothing is shared.

Collectives never sync the host with the device beyond what the backend does; a collective that
fails (a rank died, or none answered within the group's timeout) raises one ``FastARError`` naming the
rank that saw it. With ``world == 1`` nothing here runs: ``Rollout`` keeps its one-process path.
"""
from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..kernels.rows import gather_rows_auto
from .attention import FastARAttention
from .errors import FastARError
from .kvcache import KVCache
from .tempcache import TempCache, make_cache

#: Seconds a collective waits for the other ranks before it fails (``init_group``'s default).
TIMEOUT_S = 120.0


def group_size(group) -> int:
    """Ranks in ``group`` (a torch.distributed process group; ``dist.group.WORLD`` for the default one)."""
    return dist.get_world_size(group)


def check_heads(num_heads: int, world: int) -> int:
    """Heads per rank; a clear error where the heads do not divide among the ranks."""
    if num_heads % world:
        raise FastARError(f"head parallelism splits the model's {num_heads} attention heads among {world} ranks: "
                          f"{num_heads} is not divisible by {world}; run on a number of ranks that divides it")
    return num_heads // world


def init_group(backend: str | None = None, timeout_s: float = TIMEOUT_S, device: torch.device | None = None):
    """The default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), made once; None where ``WORLD_SIZE`` is unset or 1. Backend: NCCL for CUDA
    devices, gloo else."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        backend = backend or ("nccl" if device is not None and torch.device(device).type == "cuda" else "gloo")
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except Exception as exc:
            raise FastARError(f"rank {os.environ.get('RANK', '?')} of {world}: the process group ({backend}) did not "
                              f"form within {timeout_s:g} s: {exc}") from None
    return dist.group.WORLD


class HeadParallel:
    """One rank's share of a head-parallel rollout: its heads, its tokens and the collectives; the
    rollout's seam, as ``fastar.rollout.OneProcess`` is where every head is in this process."""

    def __init__(self, group, *, num_heads: int, tokens_per_frame: int):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_heads = check_heads(num_heads, self.world)
        self.num_heads = num_heads
        if tokens_per_frame % self.world:
            raise FastARError(f"head parallelism splits each latent frame's {tokens_per_frame} tokens among "
                              f"{self.world} ranks: {tokens_per_frame} is not divisible by {self.world}; pick a "
                              f"resolution whose tokens per frame it divides")
        self.tokens_per_frame = tokens_per_frame
        self.frame_shard = tokens_per_frame // self.world
        self.held = slice(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)  # the rank's heads

    # -- the seam -----------------------------------------------------------------------------
    def cache(self, config, **geometry) -> KVCache:
        """The cache of the rank's heads: TempCache deciding on whole tokens, a frame cache as it is."""
        return make_cache(config, tempcache=functools.partial(HeadParallelTempCache, parallel=self), **geometry)

    def attention(self, cache: KVCache, ann) -> FastARAttention:
        return HeadParallelAttention(cache, parallel=self, ann=ann)

    # -- collectives, each failure one error ----------------------------------------------------
    def _collective(self, what: str, fn, *args):
        try:
            fn(*args, group=self.group)
        except Exception as exc:
            raise FastARError(f"rank {self.rank} of {self.world}: {what} with the other ranks failed, which "
                              f"a rank that ended, or did not answer within the process group's timeout, "
                              f"causes: {exc}") from None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._collective("an all-reduce", dist.all_reduce, t)
        return t

    def average(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s mean over the ranks (a copy)."""
        return self.all_reduce(t.clone()) / self.world

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._collective("an all-to-all", dist.all_to_all_single, out, x)
        return out

    # -- token shards -----------------------------------------------------------------------------
    def shard_tokens(self, tokens: torch.Tensor, freqs: torch.Tensor):
        """The rank's part of a chunk's tokens [B, F, S, C] (tokens [rank*S/W, (rank+1)*S/W) of each
        frame) and of their RoPE tables [F*S, D/2, 2]."""
        b, f, s, c = tokens.shape
        lo, hi = self.rank * self.frame_shard, (self.rank + 1) * self.frame_shard
        return tokens[:, :, lo:hi].contiguous(), freqs.view(f, s, *freqs.shape[1:])[:, lo:hi].flatten(0, 1)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's part x [B, F, S/W, ...] gathered into the chunk's [B, F, S, ...]."""
        out = x.new_empty(self.world * x.shape[0], *x.shape[1:])  # ranks' parts stacked on dim 0
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._collective("an all-gather", gather, out, x.contiguous())
        return out.view(self.world, *x.shape).movedim(0, 2).flatten(2, 3)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's tokens x all heads [B, F*S/W, H, D] -> all tokens x the rank's heads [B, F*S, H/W, D]."""
        b, n, h, d = x.shape
        f = n // self.frame_shard
        send = x.view(b, n, self.world, self.local_heads, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = self._all_to_all(send)                  # [W (token shard), B, F*S/W, H/W, D]
        return recv.view(self.world, b, f, self.frame_shard, self.local_heads, d).permute(1, 2, 0, 3, 4, 5) \
            .reshape(b, f * self.tokens_per_frame, self.local_heads, d)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``to_heads``' inverse: all tokens x the rank's heads -> the rank's tokens x all heads."""
        b, n, hl, d = x.shape
        f = n // self.tokens_per_frame
        send = x.view(b, f, self.world, self.frame_shard, hl, d).permute(2, 0, 1, 3, 4, 5).contiguous()
        recv = self._all_to_all(send)                  # [W (head group), B, F, S/W, H/W, D]
        return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, f * self.frame_shard, self.num_heads, d)


class HeadParallelAttention(FastARAttention):
    """``FastARAttention`` on the rank's heads: self-attention's q, k, v arrive as the rank's tokens
    with every head and leave the same way; the KV cache, TempCache and AnnSA see all tokens of
    the rank's heads. A model reads ``parallel`` to shard its tokens (``WanModel.forward``)."""

    graph_safe = False  # collectives in a captured graph are left for the GPU work

    def __init__(self, cache, *, parallel: HeadParallel, ann=None):
        if ann is not None and ann.annca:
            raise FastARError("AnnCA does not run head-parallel (it selects prompt tokens per whole frame, which "
                              "no rank holds); set AnnConfig(annca=False), its default")
        self.parallel = parallel
        self.lsh_heads = (parallel.held, parallel.num_heads)
        self.densities_mean = parallel.average  # AnnSA decides on every rank's mean
        super().__init__(cache, ann=ann)

    def kv_rows(self, layer: int):
        return None  # the cache's rows hold all tokens of the rank's heads: K/V come in token shards

    def q_rows(self, layer: int):
        return None  # likewise q

    def self_attention(self, layer: int, q, k, v):
        p = self.parallel
        return p.to_tokens(super().self_attention(layer, p.to_heads(q), p.to_heads(k), p.to_heads(v)))

    def fill_cache(self, layer: int, q, k, v) -> None:
        p = self.parallel
        super().fill_cache(layer, p.to_heads(q), p.to_heads(k), p.to_heads(v))


class HeadParallelTempCache(TempCache):
    """TempCache on the rank's heads whose match decides on whole tokens, as one process's does: the
    partial sums over the rank's heads are all-reduced (module docstring); everything after the
    decision is per head and runs as ``TempCache``'s."""

    def __init__(self, config, *, parallel: HeadParallel, **geometry):
        if config.recall_frames:  # each rank would choose its frames by its own heads' scores
            raise FastARError("TempCache's recall_frames runs in one process: leave it 0 under head parallelism")
        self.parallel = parallel
        super().__init__(config, **geometry)

    def _match(self, new_k: torch.Tensor, hist_k: torch.Tensor, filled: torch.Tensor, canon: torch.Tensor):
        n, h, d = new_k.shape
        p = self.parallel
        held = filled[0].gather(0, canon[0])
        keys = gather_rows_auto(hist_k[None], canon[None])[0]                       # [M, H/W, D], token order
        sq = p.all_reduce(keys.float().square().sum((1, 2)))                        # |token|^2 over all heads
        scale = torch.where(held, 1.0 / sq.sqrt().clamp_min(1e-12), 0.0).to(keys.dtype)
        unit = keys.reshape(-1, h * d) * scale[:, None]
        x = new_k.reshape(n, h * d)
        idx = torch.cat([p.all_reduce(x[i:i + 1024] @ unit.T).argmax(dim=-1) for i in range(0, n, 1024)])
        slot = canon[:, idx]                                                          # [H/W, N]
        y = hist_k.gather(0, slot.T[..., None].expand(n, h, d)).float()
        xf = new_k.float()
        sums = p.all_reduce(torch.stack([(xf * y).sum((1, 2)), xf.square().sum((1, 2)), y.square().sum((1, 2))]))
        cos = sums[0] / (sums[1].sqrt() * sums[2].sqrt()).clamp_min(1e-12)
        return slot, cos.expand(h, n)
