"""The rollout engine: generate a video latent chunk by chunk over a KV cache.

For each chunk: start from noise, run the few-step flow-matching sampler (predict the flow,
take x0 = x - sigma*v, re-noise x0 to the next step with fresh noise), then run the clean
pass on x0 at ``context_noise`` so its K/V enter the cache. This is the Self-Forcing
inference loop; it drives any model that follows ``ChunkModel``.

A prompt may change along the video (``prompts``): from a chunk on, the new text conditions
the forwards, and the cached history is re-encoded with it first (LongLive's KV re-cache): the
clean passes of every earlier chunk, on its generated latent, run again through a fresh cache of
the same policy, so the cache (TempCache's merged state included) is the one those frames give
under the new prompt. Its cost is one clean pass per earlier chunk.

On CUDA, once two chunks in a row would launch the same kernels on the same buffers (the
attention state's ``graph_key``: from TempCache's budget on, or a full window), the chunk's
forwards are captured as one CUDA graph and replayed for every later chunk with that key: a
chunk is ~150 layer forwards whose Python launches otherwise set the pace, not the GPU.
The noise and the chunk's first frame go in through fixed buffers.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Iterator, Sequence

import torch

from .attention import FastARAttention
from .chunk_model import ChunkModel, ChunkReport, check_prompts, check_rollout, chunk_noise
from .config import AnnConfig, CacheConfig, TempCacheConfig
from .errors import FastARError
from .history import History
from .kvcache import KVCache
from .replay import ReplayGraph
from .schedule import FlowMatchSchedule
from .tempcache import make_cache


class OneProcess:
    """Where a rollout's heads live: every one in this process. The rollout's one seam to head
    parallelism, ``fastar.parallel.HeadParallel``, which has the same members."""

    def __init__(self, num_heads: int):
        self.local_heads = num_heads

    def cache(self, config: CacheConfig | TempCacheConfig, **geometry) -> KVCache:
        return make_cache(config, **geometry)

    def attention(self, cache: KVCache, ann: AnnConfig | None) -> FastARAttention:
        return FastARAttention(cache, ann=ann)


def _heads(group, model: ChunkModel, tokens_per_frame: int):
    """``OneProcess``, or the rank's ``HeadParallel`` where ``group`` has more than one rank."""
    if group is None:
        return OneProcess(model.num_heads)
    from .parallel import HeadParallel, group_size  # torch.distributed only where a group is given
    if group_size(group) == 1:
        return OneProcess(model.num_heads)
    if not getattr(model, "head_parallel", False):
        raise FastARError(f"{type(model).__name__} does not run head-parallel over several processes; "
                          f"the library's WanModel does (fastar.models)")
    return HeadParallel(group, num_heads=model.num_heads, tokens_per_frame=tokens_per_frame)


class Rollout:
    """One autoregressive rollout: its KV cache, sampler settings and noise.

    ``sample_chunk(c)`` runs chunk c's denoising steps and clean pass inside an open cache
    chunk; ``run`` loops ``begin_chunk -> sample_chunk -> commit`` over all chunks.

    ``cache``: a ``TempCacheConfig`` (the default: TempCache at its defaults, memory flat however long
    the video) or a ``CacheConfig`` (a window, or ``"unbounded"``: every frame, the dense baseline).

    ``start`` (image-to-video, or a world's observed past): the clean latent of the video's first
    frames [B, C, n, h, w] (a start image encodes to one): cached by clean passes before the first chunk,
    as core ComfyUI's autoregressive sampler seeds its cache, and the video's first n frames; the chunks
    follow from frame n (``first_frame``).
    """

    def __init__(self, model: ChunkModel, context: torch.Tensor, *, frames: int, height: int, width: int,
                 chunk_frames: int = 3, schedule: FlowMatchSchedule | None = None,
                 cache: CacheConfig | TempCacheConfig | None = None, seed: int = 0, context_noise: float = 0.0,
                 negative_context: torch.Tensor | None = None, cfg: float = 1.0, ann: AnnConfig | None = None,
                 cuda_graphs: bool = True, noise: Callable | None = None,
                 prompts: Sequence[tuple[int, torch.Tensor]] = (), group=None, start: torch.Tensor | None = None):
        h, w, tokens_per_frame = check_rollout(model, context, frames, height, width, chunk_frames, context_noise,
                                               start)
        self.start, self.first_frame = start, 0 if start is None else start.shape[2]
        # head parallelism over a torch.distributed process group of more than one rank (fastar.parallel):
        # every rank runs this rollout with the same arguments and holds 1/world of the heads
        self.heads = _heads(group, model, tokens_per_frame)
        self.switches = check_prompts(prompts, context, (frames - self.first_frame) // chunk_frames)
        self.negative_context = negative_context
        self.guided = cfg != 1.0
        if self.guided:
            if negative_context is None:
                raise FastARError(f"cfg={cfg} needs a negative context")
            if negative_context.shape != context.shape:
                raise FastARError(f"negative context {tuple(negative_context.shape)} must match the positive "
                                  f"context {tuple(context.shape)}")
            context = torch.cat([context, negative_context.to(context)])
        self.model, self.context, self.cfg, self.seed = model, context, cfg, seed
        # noise(chunk, step, shape, device, out=None): step 0 starts the chunk, step s > 0 re-noises
        # after step s - 1. Drawn outside any CUDA graph (into its buffers), so any generator works.
        self.noise = noise or functools.partial(chunk_noise, seed)
        self.frames, self.chunk_frames, self.context_noise = frames, chunk_frames, context_noise
        self.device = context.device
        self.sigmas = (schedule or FlowMatchSchedule()).sigmas()
        batch = context.shape[0] // (2 if self.guided else 1)
        self.chunk_shape = (batch, model.latent_channels, chunk_frames, h, w)
        cache = TempCacheConfig() if cache is None else cache  # bounded, as the CLI's and the nodes' default
        self._cache_args = dict(config=cache, num_layers=model.num_layers, batch=context.shape[0],
                                num_heads=self.heads.local_heads,
                                head_dim=model.head_dim, tokens_per_frame=tokens_per_frame,
                                chunk_frames=chunk_frames, max_frames=frames, device=self.device, dtype=model.dtype)
        self.ann = ann
        self.cache = self.heads.cache(**self._cache_args)
        self.attention = self.heads.attention(self.cache, self.ann)
        self.prompt = 0
        # chunks replay from a CUDA graph where the model allows it, and the attention (``graph_safe``: not
        # head-parallel, not a probe) at each chunk
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and getattr(model, "graph_safe", False)
        self.graph_replays = 0
        self._last_key = None  # the previous chunk's graph key
        self._graph = ReplayGraph()

    @property
    def num_chunks(self) -> int:
        return (self.frames - self.first_frame) // self.chunk_frames

    def chunk_start(self, c: int) -> int:
        """Chunk c's first frame."""
        return self.first_frame + c * self.chunk_frames

    def _inputs(self, x: torch.Tensor, timestep: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's latent and timestep inputs: twice the batch when guided (cfg != 1)."""
        x_in = torch.cat([x, x]) if self.guided else x
        return x_in, torch.full((x_in.shape[0],), float(timestep), device=self.device)

    def predict(self, x: torch.Tensor, timestep: float, frame_offset: int | torch.Tensor) -> torch.Tensor:
        """Flow prediction for the open chunk (guided when cfg != 1)."""
        x_in, t = self._inputs(x, timestep)
        v = self.model(x_in, t, self.context, frame_offset=frame_offset, attention=self.attention).float()
        if self.guided:
            v_pos, v_neg = v.chunk(2)
            v = v_neg + self.cfg * (v_pos - v_neg)
        return v

    def fill_cache(self, x0: torch.Tensor, frame_offset: int | torch.Tensor) -> None:
        """The clean pass: a forward on the clean chunk whose K/V enter the cache. Its output is
        not used: a model whose forward takes ``fill_cache`` stops after the last layer's K/V."""
        x_in, t = self._inputs(x0, self.context_noise)
        kw = {"fill_cache": True} if getattr(self.model, "fills_cache", False) else {}
        self.model(x_in, t, self.context, frame_offset=frame_offset, attention=self.attention, **kw)

    def sample_chunk(self, c: int) -> torch.Tensor:
        """Few-step sampling of chunk c, then the clean pass that writes its K/V; returns x0.
        Replayed from a CUDA graph where the chunk's key equals the previous chunk's."""
        start = self.chunk_start(c)
        self.attention.num_steps = len(self.sigmas)
        key = self.attention.graph_key() if self.cuda_graphs and self.attention.graph_safe else None
        repeat, self._last_key = key is not None and key == self._last_key, key
        if not repeat:
            noise = [self.noise(c, s, self.chunk_shape, self.device) for s in range(len(self.sigmas))]
            return self._denoise(noise, start)
        if self._graph.key == key:  # the Python-level transitions a chunk's forwards make; the graph's device work
            self.attention.begin_clean_pass()

        def buffers():
            return ([torch.empty(self.chunk_shape, device=self.device) for _ in self.sigmas],
                    torch.zeros((), dtype=torch.float64, device=self.device))

        def fill(noise, offset):
            for s, buf in enumerate(noise):
                self.noise(c, s, self.chunk_shape, self.device, out=buf)
            offset.fill_(start)

        x0 = self._graph.run(key, buffers, self._denoise, fill)
        self.graph_replays += 1
        return x0.clone()

    def _denoise(self, noise: list[torch.Tensor], frame_offset: int | torch.Tensor) -> torch.Tensor:
        """The chunk's denoising steps and clean pass, given each step's noise."""
        x = noise[0]
        for step, sigma in enumerate(self.sigmas):
            self.attention.step = step
            x0 = x - sigma * self.predict(x, 1000.0 * sigma, frame_offset)
            if step + 1 < len(self.sigmas):
                nxt = self.sigmas[step + 1]
                x = (1 - nxt) * x0 + nxt * noise[step + 1]
        self.attention.begin_clean_pass()
        self.fill_cache(x0, frame_offset)
        self.cache.join_writes()  # inside the chunk's CUDA graph, which must end on its own stream
        return x0

    def recache_chunks(self, frames_done: int) -> tuple[range, range]:
        """The chunks a switch after ``frames_done`` frames re-encodes (besides a start latent's frames,
        always): those holding the sink, and those holding the most recent frames the cache keeps past it
        (every chunk for the unbounded cache). A bounded cache's re-cache so costs the same however long
        the video."""
        c, first = self.chunk_frames, self.first_frame
        chunks = (frames_done - first) // c
        recent = self.cache.config.history_frames
        if recent is None:
            return range(chunks), range(chunks, chunks)
        sink = min(max(0, -(-(self.cache.config.sink_frames - first) // c)), chunks)
        return range(sink), range(max(sink, (frames_done - recent - first) // c), chunks)

    def held_for_switches(self, frames_done: int) -> set[int] | None:
        """The first frames of the clean latents a later prompt switch re-encodes, once ``frames_done``
        frames are made (``History``'s ``needed``): the start latent's, and the chunks ``recache_chunks``
        names (a later switch reaches no further back than one now); None where no switch is left."""
        if not any(self.chunk_start(c) >= frames_done for c in self.switches):
            return None
        sink, recent = self.recache_chunks(frames_done)
        start = {0} if self.first_frame else set()
        return start | {self.chunk_start(i) for i in (*sink, *range(recent.start, self.num_chunks))}

    def switch_prompt(self, context: torch.Tensor, frames_done: int,
                      frames: Callable[[int, int], torch.Tensor]) -> None:
        """From the next chunk on, condition on ``context``; first re-encode the history with it through
        a fresh cache of the same policy, only as far back as that cache reaches (``recache_chunks``
        after ``frames_done`` frames; ``frames(a, b)``: the clean latents of frames [a, b), [B, C, b - a,
        h, w]): the state a cache given just those frames holds. A window then holds what it would have
        held; TempCache's merged groups count only those frames' tokens, not the older ones merged into
        them before. On CUDA the clean passes replay from one graph once the cache's key repeats, as
        chunks do."""
        self.context = torch.cat([context, self.negative_context.to(context)]) if self.guided else context
        self._graph, self._last_key = ReplayGraph(), None  # a captured graph read the old text
        self.cache = self.attention = None  # free the old cache before the new one is allocated
        self.cache = self.heads.cache(**self._cache_args)
        self.attention = self.heads.attention(self.cache, self.ann)
        passes = CleanPasses(self)
        if self.first_frame:
            passes.run(frames(0, self.first_frame))
        for part in self.recache_chunks(frames_done):
            if part:
                a, b = self.chunk_start(part.start), self.chunk_start(part.stop)
                if a > self.cache.frames_cached:
                    self.cache.skip_to(a)
                passes.run(frames(a, b), a)

    def chunks(self, keep: bool = True) -> Iterator[ChunkReport]:
        """Every chunk, as it is made: a ``ChunkReport`` each, the next chunk sampled only when the caller
        asks for it (so what it changes between chunks, an action row, conditions the next), and a caller
        that stops asking ends the rollout. After the last, ``self.out`` is [B, C, frames, h, w]: the
        video's clean latents; ``keep=False`` (the frames go to the caller as they come): only the last
        chunk's, and the rollout holds just the frames a later prompt switch re-encodes (``History``), so
        its memory does not grow with the video (but for the unbounded cache's)."""
        b, ch, _, h, w = self.chunk_shape
        history, self.out = History((b, ch, self.frames, h, w), self.device, keep, self.held_for_switches), None
        if self.start is not None:
            history.add(0, self.start)
            CleanPasses(self).run(self.start)
        for c in range(self.num_chunks):
            tic = time.perf_counter()
            start = self.chunk_start(c)
            if c in self.switches:
                self.prompt += 1
                self.switch_prompt(self.switches[c], start, history.frames)
            self.cache.begin_chunk(start, self.chunk_frames)
            x0 = self.sample_chunk(c)
            telemetry = self.attention.finish_chunk()
            history.add(start, x0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield ChunkReport(c, self.num_chunks, start + self.chunk_frames, self.frames, time.perf_counter() - tic,
                              self.cache.stats(), x0, telemetry.annsa_densities, self.prompt, telemetry.annsa_sparse)
        self.out = history.out if keep else x0

    def run(self, on_chunk: Callable[[ChunkReport], None] | None = None, keep: bool = True) -> torch.Tensor:
        """Every chunk (``chunks``), ``on_chunk`` called with each report (raise in it to cancel); returns
        ``self.out``."""
        for report in self.chunks(keep):
            if on_chunk is not None:
                on_chunk(report)
        return self.out


class CleanPasses:
    """Clean passes of given clean latents into a rollout's cache, chunk by chunk: a history re-encoded
    under a new prompt (``Rollout.switch_prompt``), or real video cached (the benchmarks' testbed). On CUDA
    the passes replay from one graph once the attention state's key repeats, as chunks do; successive
    ``run`` calls continue one another."""

    def __init__(self, rollout: Rollout):
        self.rollout, self.last, self.graph = rollout, None, ReplayGraph()

    def _pass(self, x0, offset):
        self.rollout.fill_cache(x0, offset)
        self.rollout.cache.join_writes()

    def run(self, latents: torch.Tensor, start: int = 0) -> None:
        """latents [B, C, F, h, w]: chunks (the last may be short: a start latent), the first one's first
        frame ``start``."""
        r = self.rollout
        r.attention.num_steps = len(r.sigmas)
        for i in range(0, latents.shape[2], r.chunk_frames):
            x0, frame = latents[:, :, i:i + r.chunk_frames], start + i
            r.cache.begin_chunk(frame, x0.shape[2])
            key = r.attention.graph_key() if r.cuda_graphs and r.attention.graph_safe else None
            r.attention.begin_clean_pass()
            if key is None or key != self.last:
                self.last = key
                self._pass(x0, frame)
            else:
                self.graph.run(key, lambda: (torch.empty_like(x0), torch.zeros((), dtype=torch.float64, device=r.device)),
                               self._pass, lambda buf, offset: (buf.copy_(x0), offset.fill_(frame)))
            r.cache.commit()


def pad_context(context: torch.Tensor, rows: int | None) -> torch.Tensor:
    """The prompt's features padded with zero rows to the model's ``context_len``, as Wan pads umT5's
    output: the model attends those rows too, so an unpadded prompt is a different prompt."""
    if rows is None or context.shape[1] == rows:
        return context
    if context.shape[1] > rows:
        raise FastARError(f"the prompt has {context.shape[1]} tokens; this model takes at most {rows}")
    return torch.nn.functional.pad(context, (0, 0, 0, rows - context.shape[1]))


def rollout(model: ChunkModel, context: torch.Tensor, *, on_chunk: Callable[[ChunkReport], None] | None = None,
            **settings) -> torch.Tensor:
    """Generate ``frames`` latent frames at ``height`` x ``width`` pixels; returns [B, C, F, h, w].

    Settings are ``Rollout``'s: frames, height, width, chunk_frames (3), schedule, cache (TempCache at its
    defaults; ``CacheConfig("unbounded")`` keeps every frame), seed,
    context_noise (0), negative_context, cfg (1: off), ann (an ``AnnConfig``; None: dense) and
    cuda_graphs (True: replay repeating chunks from a CUDA graph where the model allows it) and
    prompts ((chunk, context) pairs: the prompt from that chunk on, the history re-encoded with it) and
    group (a torch.distributed process group: every rank calls ``rollout`` alike and holds 1/world of
    the heads, ``fastar.parallel``; None or one rank: this process alone) and start (image-to-video:
    the clean latent of the first frames, cached before the first chunk; frames counts them).
    ``context`` [B, L, context_dim] conditions every frame; with cfg != 1 both branches run batched over one cache.
    ``context`` and ``negative_context`` are padded to the model's ``context_len`` where it has one.
    ``on_chunk`` gets a ``ChunkReport`` after every chunk (raise in it to cancel).
    """
    rows = getattr(model, "context_len", None)
    if settings.get("negative_context") is not None:
        settings["negative_context"] = pad_context(settings["negative_context"], rows)
    if settings.get("prompts"):
        settings["prompts"] = [(c, pad_context(t, rows)) for c, t in settings["prompts"]]
    return Rollout(model, pad_context(context, rows), **settings).run(on_chunk)
