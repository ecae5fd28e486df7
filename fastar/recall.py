"""Recall, TempCache's memory tier: the frames a bounded cache lets go of, kept in host memory and read
back where a chunk's queries look.

TempCache holds a budget of tokens; a place seen hundreds of frames ago has long been merged into its
successors or evicted, and a returning camera finds nothing of it. Recall keeps every committed frame's
clean K/V on the host (pinned on CUDA; ``bytes_per_frame``) and, on the device, a summary of each: the
mean key of each quarter of a frame's tokens, per head (``BLOCKS`` keys a frame and layer: what the device
holds grows by 1/390 of a frame's keys at Wan 1.3B's 832x480). After a chunk, the block means of its clean pass's
queries (kept per layer in a fixed buffer, so a replayed CUDA graph writes them too) score every archived
frame older than the cache's budget by the attention mass its blocks would draw (a log-sum-exp over
queries, heads and blocks), and each layer's best ``recall_frames`` are copied into the cache's recall
rows, which the next chunk attends beside the sink, the merged history and its own chunk, unbiased.
The scores are a chunk stale (the next chunk's queries exist only once it runs): a camera's next chunk
looks at nearly what its last one did.
"""
from __future__ import annotations

import torch

BLOCKS = 4  # key blocks of a frame's summary (and of a frame's queries)


class Recall:
    """The host archive of committed frames and the choice of which of them fill the recall rows."""

    def __init__(self, frames: int, *, num_layers: int, batch: int, num_heads: int, head_dim: int,
                 tokens_per_frame: int, chunk_frames: int, device, dtype):
        self.frames, self.tokens_per_frame = frames, tokens_per_frame
        self.blocks = min(BLOCKS, tokens_per_frame)
        # token t of a frame is in block group[t]: blocks of tokens_per_frame / blocks tokens, the last ones
        # one token longer where it does not divide
        self.group = torch.arange(tokens_per_frame, device=device) * self.blocks // tokens_per_frame
        self.sizes = torch.bincount(self.group, minlength=self.blocks).float()
        self.shape = (num_layers, batch, num_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        # the clean pass's query block means, per layer: [L, B, chunk_frames * blocks, H, D], and how many hold one
        self._queries = torch.zeros(num_layers, batch, chunk_frames * self.blocks, num_heads, head_dim,
                                    device=device, dtype=dtype)
        self._noted = 0
        self._summary = torch.zeros(0, num_layers, batch, self.blocks, num_heads, head_dim, device=device,
                                    dtype=dtype)
        self._k: list[torch.Tensor] = []  # per archived frame: [L, B, T, H, D] on the host
        self._v: list[torch.Tensor] = []
        self.held = torch.full((num_layers, batch, frames), -1)  # the archived frame in each recall slot (-1: none)

    @property
    def archived(self) -> int:
        return len(self._k)

    @property
    def device_bytes(self) -> int:
        """What the tier holds on the device: the frames' summaries (they grow by ``blocks`` keys a frame
        and layer) and the noted queries."""
        return self._summary.nbytes + self._queries.nbytes

    @property
    def bytes_per_frame(self) -> int:
        """Host bytes one archived frame takes (its K and V)."""
        n = self.shape[0] * self.shape[1] * self.tokens_per_frame * self.shape[2] * self.shape[3]
        return 2 * n * self.dtype.itemsize

    def _means(self, x: torch.Tensor) -> torch.Tensor:
        """Block means [..., frames * blocks, H, D] of tokens x [..., frames * T, H, D]."""
        *lead, n, h, d = x.shape
        frames = n // self.tokens_per_frame
        x = x.float().reshape(*lead, frames, self.tokens_per_frame, h, d)
        sums = torch.zeros(*lead, frames, self.blocks, h, d, device=x.device).index_add_(len(lead) + 1, self.group, x)
        return (sums / self.sizes[:, None, None]).flatten(len(lead), len(lead) + 1).to(self.dtype)

    def note_queries(self, layer: int, q: torch.Tensor) -> None:
        """A layer's clean-pass queries [B, n, H, D] (whole frames), summarized for the next choice."""
        means = self._means(q)
        self._noted = means.shape[1]
        self._queries[layer, :, :self._noted] = means

    def archive(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Committed frames' clean K/V [L, B, frames * T, H, D] (the open chunk's rows), kept on the host."""
        frames = k.shape[2] // self.tokens_per_frame
        pin = self.device.type == "cuda"
        for i in range(frames):
            rows = slice(i * self.tokens_per_frame, (i + 1) * self.tokens_per_frame)
            for store, x in ((self._k, k), (self._v, v)):
                part = x[:, :, rows]
                store.append(torch.empty(part.shape, dtype=part.dtype, pin_memory=pin).copy_(part, non_blocking=pin))
        summary = self._means(k).unflatten(2, (frames, self.blocks)).movedim(2, 0)  # [frames, L, B, blocks, H, D]
        self._summary = torch.cat([self._summary, summary])

    def choose(self, before: int) -> torch.Tensor:
        """Each layer's and batch row's best among the ``before`` oldest archived frames [L, B, <= frames]
        (archive indices), by the mass the noted queries would put on their blocks, best first."""
        n = min(before, self.archived)
        if n <= 0 or not self._noted:
            return torch.zeros(*self.shape[:2], 0, dtype=torch.long)
        q = self._queries[:, :, :self._noted]                          # [L, B, Nq, H, D]
        s = self._summary[:n]                                          # [F, L, B, K, H, D]
        logits = torch.einsum("lbqhd,flbkhd->lbfhqk", q, s).float() / self.shape[3] ** 0.5
        logits = logits + self.sizes.log()
        score = logits.flatten(3).logsumexp(-1)                        # [L, B, F]
        return score.topk(min(self.frames, n), dim=-1).indices.cpu()

    def fill(self, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, rows: slice, chosen: torch.Tensor):
        """Copy each layer's chosen frames into its recall rows of k, v [L, B, rows, H, D] (log m 0 where
        filled, -inf where empty: ``bias`` [L, B, H, rows]); a frame chosen again stays in its slot."""
        t = self.tokens_per_frame
        for layer in range(self.shape[0]):
            for b in range(self.shape[1]):
                want, have = chosen[layer, b].tolist(), self.held[layer, b].tolist()
                kept = set(want) & set(have)
                new = [f for f in want if f not in kept]
                for j in range(self.frames):
                    if have[j] in kept:
                        continue
                    f = new.pop(0) if new else -1
                    if f == have[j]:
                        continue
                    span = slice(rows.start + j * t, rows.start + (j + 1) * t)
                    if f >= 0:
                        k[layer, b, span].copy_(self._k[f][layer, b], non_blocking=True)
                        v[layer, b, span].copy_(self._v[f][layer, b], non_blocking=True)
                    bias[layer, b, :, span] = 0.0 if f >= 0 else float("-inf")
                    self.held[layer, b, j] = f

    def recalled(self) -> int:
        """Frames held in recall rows, averaged over layers and batch rows."""
        return round((self.held >= 0).float().sum(-1).mean().item())
