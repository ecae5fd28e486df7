"""The benchmarks' testbed: the Wan 2.1 1.3B-shaped model with random weights, made sensitive.

No Wan weights can be downloaded here, and a plain random init hides approximation errors: its
query and key projections are independent, so every query spreads its attention almost evenly
over all keys of similar content, and dropping half of the cache barely moves the output. A
trained video DiT concentrates attention on a few corresponding tokens (same content, nearby
place and time: the correspondence TempCache and AnnSA rely on). ``sensitize`` gives the random
model that property, touching only its self-attention weights (``common.sensitize``):

  * the key projection is tied to the query projection (plus ``k_noise`` of fresh noise), so a
    token's query matches the keys of tokens with similar content;
  * the RMS q/k norm gains are set to ``qk_gain``: logits scale by qk_gain**2, from ~sqrt(d)
    cosine units to sharply peaked softmaxes;
  * 3-axis RoPE then turns the match into a local one in space and time, as in trained models;
  * the self-attention output projection is scaled by ``self_gain``, so what attention reads
    reaches the output.

bench/e2e_bench.py checks that the result is sensitive: the control that drops the cached history
(``OwnChunkOnly``) must score far below every FAST-AR setting, next to the bf16 noise floor.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from . import fastar, random_prompt, testbed_model
from .realvideo import DATA, _orthogonal, real_latents

CacheConfig, FastARAttention = fastar.CacheConfig, fastar.FastARAttention
PACKAGE = fastar.__name__.rsplit(".", 1)[0]  # the pack's own modules: their objects hold a rollout's state

HEIGHT, WIDTH, CHUNK, TPF, SINK = 480, 832, 3, 1560, 3


def prompt_context(text_dim: int, tokens: int = 512, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The Wan clip's own prompt as a text context [1, tokens, text_dim]: its real token features
    (all-MiniLM-L6-v2, bench/make_prompt_fixture.py) mapped to ``text_dim`` by a fixed orthogonal
    matrix, standardised, and zero-padded to ``tokens`` as Wan pads its umT5 output."""
    from safetensors.torch import load_file

    feats = load_file(os.path.join(DATA, "wan_prompt_minilm.safetensors"))["positive"].float()  # [n, 384]
    n, width = feats.shape
    if n > tokens:
        raise ValueError(f"the prompt has {n} tokens, more than tokens={tokens}")
    lift = _orthogonal(text_dim, width, seed=7).T if text_dim >= width else _orthogonal(width, text_dim, seed=7)
    x = feats @ lift
    x = (x - x.mean()) / x.std()
    out = torch.zeros(1, tokens, text_dim)
    out[0, :n] = x
    return out.to(device=device, dtype=dtype)


def testbed(dtype=torch.bfloat16, size: str = "1.3B", device: str = "cuda", prompt: str = "random"):
    """The sensitized model (1.3B-shaped unless told otherwise) and its prompt: ``random`` (a seeded
    Gaussian stand-in, 512 tokens) or ``wan`` (the real clip's prompt, ``prompt_context``)."""
    model = testbed_model(fastar, size, device, dtype)
    if prompt == "wan":
        context = prompt_context(model.context_dim, device=device, dtype=dtype)
    elif prompt == "random":
        context = random_prompt(model.context_dim, device, dtype)
    else:
        raise ValueError(f"prompt must be 'random' or 'wan', got {prompt!r}")
    return model, context


class Recorder(FastARAttention):
    """Dense cached attention that keeps the self-attention queries and the cross-attention
    (q, k, v) of selected layers."""

    graph_safe = False

    def __init__(self, cache, layers):
        super().__init__(cache)
        self.layers, self.q, self.cross = layers, {}, {}

    def self_attention(self, layer, q, k, v):
        if layer in self.layers:
            self.q[layer] = q.clone()
        return super().self_attention(layer, q, k, v)

    def cross_attention(self, layer, q, k, v):
        if layer in self.layers:
            self.cross[layer] = (q.clone(), k.clone(), v.clone())
        return super().cross_attention(layer, q, k, v)


def capture(model, context, history_frames, layers, sigma=0.625, seed=0, height=HEIGHT, width=WIDTH):
    """Teacher-forced dense pass over real latents: per-layer K/V of all frames, clean-pass queries
    per chunk, and the next chunk's self-attention queries and cross-attention (q, k, v) at one
    denoising step."""
    frames, device = history_frames + CHUNK, context.device
    latents = real_latents(frames, height, width).to(device)
    kv = fastar.make_cache(CacheConfig("unbounded"), num_layers=model.num_layers, batch=1,
                           num_heads=model.num_heads, head_dim=model.head_dim,
                           tokens_per_frame=(height // 16) * (width // 16), chunk_frames=CHUNK, max_frames=frames,
                           device=device, dtype=model.dtype)
    rec = Recorder(kv, set(layers))
    clean_q = {layer: [] for layer in layers}
    zero = torch.zeros(1, device=device)
    with torch.inference_mode():
        for c in range(history_frames // CHUNK):
            kv.begin_chunk(c * CHUNK, CHUNK)
            kv.begin_clean_pass()
            model(latents[:, :, c * CHUNK:(c + 1) * CHUNK], zero, context, frame_offset=c * CHUNK, attention=rec)
            kv.commit()
            for layer in layers:
                clean_q[layer].append(rec.q[layer])
        g = torch.Generator(device=device).manual_seed(seed)
        x0 = latents[:, :, history_frames:]
        x = (1 - sigma) * x0 + sigma * torch.randn(x0.shape, device=device, generator=g)
        kv.begin_chunk(history_frames, CHUNK)
        model(x, torch.full((1,), 1000 * sigma, device=device), context, frame_offset=history_frames, attention=rec)
    query_q = {layer: rec.q[layer] for layer in layers}
    return kv, clean_q, query_q, dict(rec.cross)


class NoAttention(FastARAttention):
    """Attention removed (self and cross return q): what remains of a forward is its floor."""

    def self_attention(self, layer, q, k, v):
        return q

    def cross_attention(self, layer, q, k, v):
        return q


def prefill(run, frames: int) -> None:
    """Fill a rollout's cache with ``frames`` frames of random K/V through the cache protocol."""
    kv, g = run.cache, torch.Generator(device=run.device).manual_seed(1)
    shape = (kv.batch, CHUNK * kv.tokens_per_frame, kv.num_heads, kv.head_dim)
    k = torch.randn(shape, device=run.device, dtype=kv.dtype, generator=g)
    v = torch.randn(shape, device=run.device, dtype=kv.dtype, generator=g)
    for c in range(frames // CHUNK):
        kv.begin_chunk(c * CHUNK, CHUNK)
        kv.begin_clean_pass()
        for layer in range(kv.num_layers):
            kv.attend(layer, k, v)
        kv.commit()


class OwnChunkOnly(FastARAttention):
    """The control that drops the cached history: each chunk attends only its own keys."""

    def self_attention(self, layer, q, k, v):
        keys, values, _ = self.cache.attend(layer, k, v)
        own = self.cache.layout.chunk
        return fastar.attend(q, keys[:, own], values[:, own])


def continue_real_video(run, prefix_frames: int, latents: torch.Tensor | None = None, on_chunk=None):
    """Teacher-force a rollout on ``prefix_frames`` real latent frames (their clean passes fill the
    cache), then let it generate the rest; returns the generated latents [B, C, F - prefix, h, w]."""
    ch = run.chunk_frames
    if prefix_frames % ch:
        raise ValueError(f"prefix_frames={prefix_frames} must be a multiple of the chunk ({ch})")
    if latents is None:
        b, c, _, h, w = run.chunk_shape
        latents = real_latents(prefix_frames, h * 8, w * 8).to(run.device)
    outs = []
    for c in range(run.num_chunks):
        start = c * ch
        run.cache.begin_chunk(start, ch)
        if start < prefix_frames:
            run.cache.begin_clean_pass()
            run.attention.step = len(run.sigmas)
            run.fill_cache(latents[:, :, start:start + ch].to(run.model.dtype), start)
        else:
            outs.append(run.sample_chunk(c))
        run.cache.commit()
        if on_chunk is not None:
            on_chunk(c)
    return torch.cat(outs, dim=2)


class RealVideoHistory:
    """``continue_real_video``'s teacher forcing in steps: ``to(frames)`` runs the clean passes of the real
    latents up to ``frames`` (the history a generation then continues), on a CUDA device replayed from one
    graph once the attention state's key repeats (``fastar.rollout.CleanPasses``, as a prompt switch
    re-encodes a history: a TempCache pass is ~7000 launches, host-bound when eager: bench/NOTES.md)."""

    def __init__(self, run, latents: torch.Tensor):
        self.run, self.latents, self.frames = run, latents, 0
        self._passes = importlib.import_module(f"{fastar.__name__}.rollout").CleanPasses(run)

    def to(self, frames: int) -> None:
        ch = self.run.chunk_frames
        if frames % ch or frames < self.frames or frames > self.latents.shape[2]:
            raise ValueError(f"cannot cache up to frame {frames}: {self.frames} cached, chunks of {ch}, "
                             f"{self.latents.shape[2]} real frames")
        self._passes.run(self.latents[:, :, self.frames:frames].to(self.run.model.dtype), self.frames)
        self.frames = frames


def generate(run, chunks: int) -> torch.Tensor:
    """``chunks`` more chunks sampled after what the rollout's cache holds (its noise is the chunk's own, as
    in ``continue_real_video``); the latents [B, C, chunks * chunk_frames, h, w]."""
    outs, first = [], run.cache.frames_cached // run.chunk_frames
    for c in range(first, first + chunks):
        run.cache.begin_chunk(c * run.chunk_frames, run.chunk_frames)
        outs.append(run.sample_chunk(c))
        run.cache.commit()
    return torch.cat(outs, dim=2)


_MISSING = object()
_CONFIGS = (fastar.AnnConfig, fastar.CacheConfig, fastar.TempCacheConfig)


def copy_state(src, dst, _seen=None) -> None:
    """Make ``dst`` hold the state ``src`` holds, for a KV cache or an attention state (and the package
    objects they hold: AnnSA, AnnCA, LSH) of two rollouts of one geometry: tensors copied into ``dst``'s
    own where their shapes match (its buffers stay where a CUDA graph reads them), cloned otherwise;
    lists, tuples and dicts item by item; Python values taken over. ``dst`` keeps its configs (AnnSA's may
    differ in the dense steps, a schedule's setting no cached state depends on), its models and callables,
    and whatever attributes ``src`` lacks (a probe's). Generic on purpose: whatever a cache or attention
    state comes to hold follows without a list here to update. Call it under
    ``torch.inference_mode()`` (the rollouts' tensors are inference tensors)."""
    seen = {} if _seen is None else _seen
    seen[id(src)] = dst
    for name, value in vars(src).items():
        old = getattr(dst, name, _MISSING)
        if value is old or isinstance(value, (torch.nn.Module, *_CONFIGS)) or (
                callable(value) and not isinstance(value, torch.Tensor)):
            continue
        new = _copied(value, old, seen)
        if new is not old:
            setattr(dst, name, new)


def _copied(value, old, seen):
    if isinstance(value, torch.Tensor):
        if (isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype
                and old.device == value.device):
            try:
                return old.copy_(value)
            except RuntimeError:  # an expanded view (several elements, one address): replaced instead
                pass
        return value.clone()
    if isinstance(value, (list, tuple)):
        olds = old if type(old) is type(value) and len(old) == len(value) else [_MISSING] * len(value)
        items = [_copied(v, o, seen) for v, o in zip(value, olds)]
        if isinstance(value, list) and olds is old:
            old[:] = items
            return old
        return items if isinstance(value, list) else type(value)(items)
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: _copied(v, olds.get(k, _MISSING), seen) for k, v in value.items()}
    if type(value).__module__.startswith(PACKAGE) and hasattr(value, "__dict__") and not (
            dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen):
        if id(value) in seen:
            return seen[id(value)]
        if not isinstance(old, type(value)):
            raise TypeError(f"copy_state: {type(value).__name__} has no counterpart to copy into (got {old!r})")
        copy_state(value, old, seen)
        return old
    return value


def fork(run, make):
    """A rollout ``make()`` builds (same model geometry, frames and cache policy) holding ``run``'s state
    (``copy_state`` of its cache and attention): it continues as ``run`` would, ``run`` left untouched."""
    twin, seen = make(), {}
    with torch.inference_mode():
        copy_state(run.cache, twin.cache, seen)
        copy_state(run.attention, twin.attention, seen)
    return twin


def probe_annsa(attention, layers):
    """AnnSA's recall measured on an attention state a rollout made (whatever its settings), not a new one:
    every sparse self-attention call of ``layers`` records its plan's recall of the dense attention mass and
    its key density into the returned lists (recalls, densities), through AnnSA's ``observer``. The state
    reads them on the host from then on, so its rollout replays no CUDA graph."""
    from comfyui_fastar.testing.annsa import plan_density, recall

    recalls, densities, layers = [], [], set(layers)
    annsa = attention.annsa

    def observe(layer, q, keys, bias, plan):
        if layer in layers:
            recalls.append(recall(annsa, q, keys, bias, plan).item())
            densities.append(plan_density(*plan, keys.shape[1]).item())
    annsa.observer = observe
    attention.graph_safe = False
    return recalls, densities


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB with the reference's value range as the peak."""
    x, ref = x.float(), ref.float()
    mse = (x - ref).pow(2).mean()
    return (10 * torch.log10((ref.max() - ref.min()) ** 2 / mse)).item()


def ssim(x: torch.Tensor, ref: torch.Tensor, window: int = 7) -> float:
    """Mean SSIM over latent channels and frames (uniform window, the reference's range as L)."""
    x, ref = x.float().flatten(0, 2).unsqueeze(1), ref.float().flatten(0, 2).unsqueeze(1)  # [N, 1, h, w]
    rng = (ref.max() - ref.min()).item()
    c1, c2 = (0.01 * rng) ** 2, (0.03 * rng) ** 2
    pool = torch.nn.functional.avg_pool2d
    mx, my = pool(x, window, 1), pool(ref, window, 1)
    vx, vy = pool(x * x, window, 1) - mx * mx, pool(ref * ref, window, 1) - my * my
    cov = pool(x * ref, window, 1) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.mean().item()
