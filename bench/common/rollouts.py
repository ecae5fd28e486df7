"""The rollouts the end-to-end benchmarks share (bench/e2e_bench.py, bench/frontier.py, bench/chunk_profile.py):
the settings by name, a setting's rollout, a real rollout's per-chunk latency and memory and its steady state,
and the fidelity table (``Fidelity``: generated latents after real cached frames against dense attention).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from . import fastar
from .realvideo import real_latents
from .testbed import CHUNK, OwnChunkOnly, RealVideoHistory, continue_real_video, fork, generate, probe_annsa, psnr, ssim

AnnConfig, CacheConfig, TempCacheConfig = fastar.AnnConfig, fastar.CacheConfig, fastar.TempCacheConfig

SETTINGS = {  # name: (cache, ann)
    "dense": (CacheConfig("unbounded"), None),
    "sink+window": (CacheConfig("window", 3, 12), None),
    "tempcache": (TempCacheConfig(), None),
    "annsa": (CacheConfig("unbounded"), AnnConfig(annca=False)),
    "annca": (CacheConfig("unbounded"), AnnConfig(annsa=False, annca=True)),
    "fastar": (TempCacheConfig(), None),  # the pack's defaults: TempCache alone (AnnSA and AnnCA are opt-in)
}
PROBE_LAYERS = (9, 19)  # layers whose AnnSA recall the fidelity runs measure (as bench/ann_bench.py)


def peak_gb(device):
    """Peak GB of tensors the allocator handed out. A chunk replayed from a CUDA graph allocates
    nothing: its working memory sits in the graph's pool, which only ``held_gb`` counts."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")


def held_gb(device):
    """Peak GB the process held on the device: the caching allocator's reserve, CUDA graph pools
    included, and also blocks it keeps cached for reuse (an upper bound of what was in use)."""
    return torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else float("nan")


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def make_run(model, context, frames, hw, name, attention=None, cuda_graphs=True, settings=SETTINGS):
    """The rollout of setting ``name``: ``settings[name]`` is (cache, ann) or (cache, ann, options), options
    the Rollout's further keywords, "model": the model this setting runs (fp8 linears: another module
    over the same weights), and "attention". ``attention`` (a class or a callable over the cache; the
    setting's own, else the argument) replaces its attention state."""
    cache, ann, *options = settings[name]
    options = dict(options[0]) if options else {}
    model = options.pop("model", model)
    attention = options.pop("attention", attention)
    run = fastar.Rollout(model, context, frames=frames, height=hw[0], width=hw[1], chunk_frames=CHUNK, cache=cache,
                         ann=ann, cuda_graphs=cuda_graphs, **options)
    if attention is not None:
        run.attention = attention(run.cache)
    return run


def real_rollout(model, context, chunks, hw, name, log_every=40, cuda_graphs=True, settings=SETTINGS):
    """Per-chunk latency and peak memory of a real rollout (peak reset before every chunk), and AnnSA's density
    after the last chunk (its plans' own output: no kernel in the timed chunks)."""
    device = context.device
    reset_peak(device)
    rows = []
    run = make_run(model, context, chunks * CHUNK, hw, name, cuda_graphs=cuda_graphs, settings=settings)

    def on_chunk(r):
        rows.append({"frames": r.frames_done, "latency_ms": 1e3 * r.latency_s, "peak_gb": peak_gb(device),
                     "held_gb": held_gb(device),
                     "cache_gb": r.cache.gb, "tokens_held": r.cache.tokens_held, "source": "rollout"})
        if r.chunk + 1 == r.num_chunks and r.annsa_density is not None:  # the clean pass's plans, every layer
            rows[-1]["annsa_density"] = r.annsa_density
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if r.chunk % log_every == 0 or r.chunk + 1 == r.num_chunks:
            row = rows[-1]
            print(f"  {name:12s} chunk {r.chunk:4d}: {row['latency_ms']:8.1f} ms  peak {row['peak_gb']:6.1f} GB "
                  f" held {r.cache.tokens_held} tokens", flush=True)
    with torch.inference_mode():
        run.run(on_chunk)
    del run
    return rows


def chunks_for(held: int, extra: int = 0) -> int:
    """Chunks of a rollout whose cache is full (``held`` frames) for its last 5 chunks (``steady_state``'s)."""
    return math.ceil(held / CHUNK) + 5 + extra


def steady_state(rows, last=5):
    """A short rollout's summary, as the side-by-side runners compare settings: the median latency of
    its ``last`` chunks, AnnSA's density (recorded in the last chunk; 1.0 without AnnSA) and every
    chunk's latency."""
    return {"ms": statistics.median(r["latency_ms"] for r in rows[-last:]),
            "density": rows[-1].get("annsa_density", 1.0),
            "all_ms": [round(r["latency_ms"], 1) for r in rows]}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sharing(settings, name):
    """What a setting's cached history depends on: its cache, its AnnSA / AnnCA but the dense steps (the
    clean pass, all a history is, runs sparse whatever their share, unless it is 1), its further options;
    and for an unbounded cache, whose copy would double the largest tensor of the run, its own name."""
    cache, ann, *options = settings[name]
    bounded = isinstance(cache, TempCacheConfig) or cache.bounded
    if ann is not None:
        ann = dataclasses.replace(ann, dense_steps_fraction=0.0 if ann.dense_steps_fraction < 1 else 1.0)
    options = tuple(sorted((k, id(v) if isinstance(v, torch.nn.Module) else v)
                           for k, v in (options[0] if options else {}).items()))
    return repr(cache), repr(ann), options, None if bounded else name


class Fidelity:
    """Generated latents after each horizon of real cached frames, against dense bf16 (``settings``'
    "dense"), beside the bf16 noise floor (dense fp32 against dense bf16; at ``floor_horizons`` only, default
    every horizon: elsewhere None and a note of what it would need) and the control that drops the cached
    history; per other setting PSNR / SSIM, the share of the dense cache it holds and, where AnnSA runs, the
    recall and density of its sparse calls on the generated chunks (``probe_annsa``).

    ``references()`` first, then ``measure(names)`` for each of ``groups()`` (or some), then ``table()``.
    The work is shared: settings whose cached history is one (``sharing``: the same bounded cache and the
    same AnnSA but its dense steps) cache the real video once, up to the longest horizon (``RealVideoHistory``:
    its repeating clean passes replayed from a CUDA graph), and at each horizon each generates from a copy of
    that state (``fork``), the last one in place; an unbounded setting caches it once per horizon. ``walls``
    holds each setting's seconds: its generations and its share of the history it cached."""

    def __init__(self, model, model32, context, horizons, hw, gen_frames, settings=SETTINGS, floor_horizons=None):
        self.model, self.model32, self.context, self.hw, self.gen_frames = model, model32, context, hw, gen_frames
        self.settings, self.horizons = settings, sorted(horizons)
        self.floor_at = set(self.horizons) if floor_horizons is None else set(floor_horizons)
        self.probe_layers = [i for i in PROBE_LAYERS if i < model.num_layers] or [model.num_layers - 1]
        self.latents = real_latents(self.horizons[-1], hw[0], hw[1]).to(context.device)
        self.rows = {h: {"history_frames": h, "generated_frames": gen_frames} for h in self.horizons}
        self.refs, self.walls = {}, {}

    def _reference(self, history, m=None, ctx=None, attention=None):
        run = make_run(m or self.model, self.context if ctx is None else ctx, history + self.gen_frames, self.hw,
                       "dense", attention, settings=self.settings)
        with torch.inference_mode():
            return continue_real_video(run, history, self.latents[:, :, :history])

    def references(self):
        """Dense bf16 at every horizon, the noise floor where asked, the own-chunk control."""
        model, tpf = self.model, (self.hw[0] // 16) * (self.hw[1] // 16)
        for history in self.horizons:
            tic = time.time()
            ref, row = self._reference(history), self.rows[history]
            if history in self.floor_at:
                torch.backends.cuda.matmul.allow_tf32 = False
                ref32 = self._reference(history, self.model32, self.context.float())
                torch.backends.cuda.matmul.allow_tf32 = True
                row["noise_floor"] = {"psnr": psnr(ref, ref32), "ssim": ssim(ref, ref32)}
                del ref32
            else:
                frames = history + self.gen_frames
                gb = 2 * model.num_layers * tpf * model.num_heads * model.head_dim * 4 * frames / 1e9
                row["noise_floor"] = None
                row["noise_floor_note"] = (f"not measured: the dense fp32 reference's K/V over {frames} frames "
                                           f"take {gb:.3g} GB besides the models")
            own = self._reference(history, attention=OwnChunkOnly)
            row["own_chunk_only"] = {"psnr": psnr(own, ref), "ssim": ssim(own, ref)}
            self.refs[history] = ref
            print(f"  references after {history} frames: {time.time() - tic:.1f} s", flush=True)

    def groups(self, names=None) -> list[list[str]]:
        """``names`` (default every setting but "dense") in groups that share one cached history."""
        groups = {}
        for name in (n for n in self.settings if n != "dense") if names is None else names:
            groups.setdefault(sharing(self.settings, name), []).append(name)
        return list(groups.values())

    def measure(self, names):
        """The settings ``names`` (one of ``groups()``) at every horizon."""
        if sharing(self.settings, names[0])[-1] is None:
            self._cached_once(names, self.horizons)
        else:
            for h in self.horizons:
                self._cached_once(names, [h])

    def _cached_once(self, names, hs):
        """One history for ``names``, forked at each of the horizons ``hs``."""
        model, context, hw, settings, device = self.model, self.context, self.hw, self.settings, self.context.device
        frames = hs[-1] + self.gen_frames
        run = make_run(model, context, frames, hw, names[0], settings=settings)
        history = RealVideoHistory(run, self.latents)
        for i, h in enumerate(hs):
            tic = time.time()
            with torch.inference_mode():
                history.to(h)
            _sync(device)
            spent = time.time() - tic
            for name in names:
                self.walls[name] = self.walls.get(name, 0.0) + spent / len(names)
            print(f"  cached {h} real frames for {', '.join(names)}: {spent:.1f} s", flush=True)
            for name in names[1:] + names[:1]:  # the run's own setting last: at the last horizon, in place
                tic = time.time()
                if i + 1 == len(hs) and name == names[0]:
                    gen, run.cuda_graphs = run, False
                else:
                    gen = fork(run, lambda name=name: make_run(model, context, frames, hw, name, cuda_graphs=False,
                                                               settings=settings))
                ann = settings[name][1]
                probe = probe_annsa(gen.attention, self.probe_layers) if ann is not None and ann.annsa else None
                with torch.inference_mode():
                    out = generate(gen, self.gen_frames // CHUNK)
                stats = gen.cache.stats()
                r = {"psnr": psnr(out, self.refs[h]), "ssim": ssim(out, self.refs[h]),
                     "kv_held": stats.tokens_held / max(stats.dense_tokens, 1)}
                if probe is not None and probe[0]:  # (a schedule may keep every call dense)
                    r.update(annsa_recall=statistics.mean(probe[0]), annsa_density=statistics.mean(probe[1]),
                             annsa_layers=self.probe_layers)
                self.rows[h][name] = r
                del gen
                spent = time.time() - tic
                self.walls[name] = self.walls.get(name, 0.0) + spent
                print(f"    {name} after {h} frames: {r['psnr']:.1f} dB / {r['ssim']:.4f}, held {r['kv_held']:.2f}"
                      + (f", recall {r['annsa_recall']:.3f} @ {r['annsa_density']:.3f}" if "annsa_recall" in r
                         else "") + f" ({spent:.1f} s)", flush=True)
        del run, history

    def table(self, quiet=False) -> list[dict]:
        """One row per horizon: references first, then the settings measured, in ``settings``' order."""
        out = []
        for history in self.horizons:
            row = self.rows[history]
            row = {**{k: v for k, v in row.items() if k not in self.settings},
                   **{n: row[n] for n in self.settings if n in row}}
            out.append(row)
            if quiet:
                continue
            print(f"fidelity after {history} frames: " + "  ".join(
                f"{k} {v['psnr']:.1f} dB/{v['ssim']:.4f}" for k, v in row.items() if isinstance(v, dict)), flush=True)
            print("  cache held / dense, AnnSA recall @ density: " + "  ".join(
                f"{k} {v['kv_held']:.2f}" + (f" {v['annsa_recall']:.3f} @ {v['annsa_density']:.3f}"
                                             if "annsa_recall" in v else "")
                for k, v in row.items() if isinstance(v, dict) and "kv_held" in v), flush=True)
        return out
