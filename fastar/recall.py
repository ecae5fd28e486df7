"""Recall, TempCache's memory tier: the frames a bounded cache lets go of, kept in host memory and read
back where a chunk's queries look.

TempCache holds a budget of tokens; a place seen hundreds of frames ago has long been merged into its
successors or evicted, and a returning camera finds nothing of it. Recall keeps committed frames' clean
K/V in host memory (pageable: ``bytes_per_frame`` each, up to ``ARCHIVE_BYTES`` or ``ARCHIVE_FRAMES``, past
which the oldest frames are thinned) and, on the device, a summary of each: the mean key of each quarter of a frame's
tokens, per head (``BLOCKS`` keys a frame and layer). After a chunk, the block means of its clean pass's
queries (kept per layer in a fixed buffer, so a replayed CUDA graph writes them too) score every archived
frame by the attention mass its blocks would draw (a log-sum-exp over queries, heads and blocks), and each
layer's best ``frames`` go into the cache's recall rows, which a later chunk attends beside the sink, the
merged history and its own chunk, unbiased.

Nothing of this waits on the host. At a commit the device copies the chunk's rows aside and scores the
archive; a worker thread then moves the rows into the archive, reads the choice, and uploads the frames it
adds into a device copy of the recall rows; the next commit swaps that copy in. So the rows a chunk
attends were chosen by the queries of the chunk two before it (a camera looks at nearly what it looked
at a moment ago), among the frames older than the budget then, and the host's copies overlap sampling.
"""
from __future__ import annotations

import weakref

import torch

from .handoff import Handoff

BLOCKS = 4  # key blocks of a frame's summary (and of a frame's queries)
ARCHIVE_BYTES = 16 << 30  # host bytes the archive may hold, and at most ARCHIVE_FRAMES frames (their summaries
ARCHIVE_FRAMES = 1024     # are on the device); past either the oldest frames are thinned


class Recall:
    """The host archive of committed frames and the choice of which of them fill the recall rows. Frames
    are counted from the first archived (the first past the sink)."""

    def __init__(self, frames: int, *, num_layers: int, batch: int, num_heads: int, head_dim: int,
                 tokens_per_frame: int, chunk_frames: int, history_frames: int, device, dtype,
                 archive_bytes: int = ARCHIVE_BYTES):
        self.frames, self.tokens_per_frame, self.chunk_frames = frames, tokens_per_frame, chunk_frames
        self.history_frames = history_frames
        self.blocks = min(BLOCKS, tokens_per_frame)
        # token t of a frame is in block group[t]: blocks of tokens_per_frame / blocks tokens, the last ones
        # one token longer where it does not divide
        self.group = torch.arange(tokens_per_frame, device=device) * self.blocks // tokens_per_frame
        self.sizes = torch.bincount(self.group, minlength=self.blocks).float()
        self.shape = (num_layers, batch, num_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.capacity = max(2 * frames + chunk_frames, min(ARCHIVE_FRAMES, archive_bytes // self.bytes_per_frame))
        slots = self.capacity + chunk_frames  # a chunk's frames join before the thinning makes room
        # the clean pass's query block means, per layer: [L, B, chunk_frames * blocks, H, D], and how many hold one
        self._queries = torch.zeros(num_layers, batch, chunk_frames * self.blocks, num_heads, head_dim,
                                    device=device, dtype=dtype)
        self._noted = 0
        # per summary slot: the frame's block means [slots, L, B, K, H, D] and which frame it is (-1: none)
        self._summary = torch.zeros(slots, num_layers, batch, self.blocks, num_heads, head_dim, device=device,
                                    dtype=dtype)
        self._slot_frame = torch.full((slots,), -1, dtype=torch.long, device=device)
        self._slots: dict[int, int] = {}  # archived frame -> its summary slot (the host's view, in order)
        self._free = list(range(slots))
        self._host: dict[int, torch.Tensor] = {}  # archived frame -> its K/V [2, L, B, T, H, D] (the worker's)
        self._spare: list[torch.Tensor] = []      # the host memory of frames thinned out, for the next ones
        # the chunk's rows copied aside for the worker ([2, L, B, chunk * T, H, D]) and the recall rows the
        # worker builds for the next commit, with their bias
        self._staged = torch.empty(2, num_layers, batch, chunk_frames * tokens_per_frame, num_heads, head_dim,
                                   device=device, dtype=dtype)
        self._next = torch.zeros(2, num_layers, batch, frames * tokens_per_frame, num_heads, head_dim,
                                 device=device, dtype=dtype)
        self._next_bias = torch.full((num_layers, batch, num_heads, frames * tokens_per_frame), float("-inf"),
                                     device=device)
        self.held = torch.full((num_layers, batch, frames), -1)  # the archived frame in each recall slot (-1: none)
        self._planned = self.held.clone()                        # what the worker's copy holds
        # one job a commit, in a thread on its own stream after the commit's work (never while a CUDA graph
        # captures: its copies allocate), done before the next commit
        self._worker = Handoff(lambda job: job(), self.device, threaded=True, name="fastar-recall")
        weakref.finalize(self, self._worker.close, False)
        self.archived_total = 0

    @property
    def archived(self) -> int:
        """Frames the archive holds now."""
        return len(self._slots)

    @property
    def device_bytes(self) -> int:
        """What the tier holds on the device: the summaries, the noted queries, the chunk's rows copied aside
        and the next recall rows."""
        return sum(t.nbytes for t in (self._summary, self._slot_frame, self._queries, self._staged, self._next,
                                      self._next_bias))

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

    def commit(self, k: torch.Tensor, v: torch.Tensor, rows: slice, bias: torch.Tensor,
               new: slice) -> None:
        """After a chunk's clean pass: the recall rows ``rows`` of k, v [L, B, rows, H, D] (``bias`` [L, B, H,
        rows]: 0 filled, -inf empty) take what the worker built since the last commit; the chunk's rows ``new``
        go to the archive, and the frames the recall rows hold two commits on are chosen."""
        self._worker.drain()
        self.held.copy_(self._planned)
        k[:, :, rows].copy_(self._next[0])
        v[:, :, rows].copy_(self._next[1])
        bias[..., rows].copy_(self._next_bias)
        # the chunk's rows, copied aside (they are the next chunk's to write) and summarized
        n = (new.stop - new.start) // self.tokens_per_frame
        first = self.archived_total
        self._staged[0, :, :, :new.stop - new.start].copy_(k[:, :, new])
        self._staged[1, :, :, :new.stop - new.start].copy_(v[:, :, new])
        summary = self._means(k[:, :, new]).unflatten(2, (n, self.blocks)).movedim(2, 0)  # [n, L, B, K, H, D]
        for i in range(n):
            slot = self._free.pop()
            self._slots[first + i] = slot
            self._summary[slot] = summary[i]
            self._slot_frame[slot] = first + i
        self.archived_total += n
        dropped = self._thin()
        # the next commit's rows attend from the commit after it on: the frames older than the budget then
        limit = self.archived_total + self.chunk_frames - self.history_frames
        chosen = self._choose(limit)
        self._worker.put(lambda: self._archive_and_plan(first, n, dropped, chosen))

    def _thin(self) -> list[int]:
        """Past the archive's capacity, the frame whose neighbours lie closest for its age goes (the oldest
        where they tie): the gaps between the frames kept grow with their age, so the archive holds the recent
        past densely and the far past ever more sparsely, back to the first frame."""
        dropped, now = [], self.archived_total
        while len(self._slots) > self.capacity:
            order = list(self._slots)
            _, i = min(((order[i + 1] - order[i - 1]) / (now - order[i]), i) for i in range(1, len(order) - 1))
            slot = self._slots.pop(order[i])
            self._slot_frame[slot] = -1
            self._free.append(slot)
            dropped.append(order[i])
        return dropped

    def _choose(self, limit: int) -> torch.Tensor:
        """Each layer's and batch row's best archived frames older than ``limit`` [L, B, frames] (-1 where
        there are fewer), by the mass the noted queries would put on their blocks, best first; on the device,
        copied to the host without a wait."""
        candidates = sum(f < limit for f in self._slots)
        if candidates == 0 or not self._noted:
            return torch.full((*self.shape[:2], self.frames), -1, dtype=torch.long)
        q = self._queries[:, :, :self._noted]                          # [L, B, Nq, H, D]
        logits = torch.einsum("lbqhd,slbkhd->lbshqk", q, self._summary).float() / self.shape[3] ** 0.5
        score = (logits + self.sizes.log()).flatten(3).logsumexp(-1)   # [L, B, slots]
        frame = self._slot_frame
        score = score.masked_fill(((frame < 0) | (frame >= limit)), float("-inf"))
        top = score.topk(min(self.frames, candidates), dim=-1).indices
        chosen = torch.full((*self.shape[:2], self.frames), -1, dtype=torch.long, device=self.device)
        chosen[..., :top.shape[-1]] = frame[top]
        host = torch.empty(chosen.shape, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return host.copy_(chosen, non_blocking=True)

    def _archive_and_plan(self, first: int, n: int, dropped: list[int], chosen: torch.Tensor) -> None:
        """The worker's part of a commit: the chunk's rows into host memory, then the next recall rows. Both
        ways the copies go through pinned memory from torch's host cache (pinned once, then reused): a copy
        from pageable memory runs at a fraction of the copy engine's rate."""
        cuda = self.device.type == "cuda"
        if cuda:  # the worker's stream waits for the commit: so does the host (``chosen``)
            torch.cuda.current_stream(self.device).synchronize()
        t = self.tokens_per_frame
        for f in dropped:  # its memory kept for a later frame: a fresh allocation faults in every page
            if f in self._host:
                self._spare.append(self._host.pop(f))
        if n:
            rows = self._staged[:, :, :, :n * t]
            pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=cuda).copy_(rows, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()
            for i in range(n):  # the archive itself pageable: the host's pinned memory stays one chunk's
                frame = pinned[:, :, :, i * t:(i + 1) * t]
                host = self._spare.pop() if self._spare else torch.empty(frame.shape, dtype=frame.dtype)
                self._host[first + i] = host.copy_(frame)
        self._plan(chosen)

    def _plan(self, chosen: torch.Tensor) -> None:
        """Each layer's chosen frames into its slots of the next recall rows; a frame chosen again stays in its
        slot, and a slot keeps its frame until another takes it (so rows once filled stay filled: the cache
        reads them as one dense span)."""
        t, uploads = self.tokens_per_frame, []
        for layer in range(self.shape[0]):
            for b in range(self.shape[1]):
                want = [f for f in chosen[layer, b].tolist() if f >= 0 and f in self._host]
                have = self._planned[layer, b].tolist()
                kept = set(want) & set(have)
                new = [f for f in want if f not in kept]
                for j in range(self.frames):
                    if have[j] in kept:
                        continue
                    f = new.pop(0) if new else have[j]
                    if f == have[j]:
                        continue
                    span = slice(j * t, (j + 1) * t)
                    if f >= 0:
                        uploads.append((layer, b, span, f))
                    self._next_bias[layer, b, :, span] = 0.0 if f >= 0 else float("-inf")
                    self._planned[layer, b, j] = f
        if uploads:  # gathered into one pinned buffer, uploaded at once, placed on the device
            cuda = self.device.type == "cuda"
            pinned = torch.empty(len(uploads), 2, t, *self.shape[2:], dtype=self.dtype, pin_memory=cuda)
            for i, (layer, b, _, f) in enumerate(uploads):
                pinned[i].copy_(self._host[f][:, layer, b])
            frames = pinned.to(self.device, non_blocking=cuda)
            for i, (layer, b, span, _) in enumerate(uploads):
                self._next[:, layer, b, span].copy_(frames[i])

    @property
    def full(self) -> bool:
        """Whether every recall row holds a frame (for the next chunk: read on the host, no sync)."""
        return bool((self.held >= 0).all())

    def recalled(self) -> int:
        """Frames held in recall rows, averaged over layers and batch rows."""
        return round((self.held >= 0).float().sum(-1).mean().item())

