"""Every cache judged by what the trained world model remembers (``assets/world.safetensors``).

On each held-out photograph (``assets/worlds/heldout``) the camera flies an out-and-back
(``fastar.photo_world.revisit_actions``): a lead-in, a loop of N video frames that takes the place it starts
from out of view, then the loop's first leg again, which shows that place once more. The model is shown
the ground truth up to the loop's first leg (``observed``) and makes the rest; on the revisited frames
its video is compared with the ground truth and with the dense cache's video, for N = 48, 96, 192, 384:

* ``dense``: every frame cached; ``own chunk``: no history at all (the control: what the model makes
  of the actions alone);
* ``window W``: a sink of 3 frames + the last W - 3 frames (W frames held), LongLive's rule, up to
  the sizes that cost what TempCache does;
* ``tempcache B @ t``: TempCache at a budget of B frames (sink 3 included), merge threshold t;
* ``tempcache B @ t + AnnSA``: with AnnSA's sparse self-attention at its defaults (B = 15, 21: below
  15 frames it stands aside);
* ``tempcache 12 @ 0.8 + recall R``: with the memory tier (``fastar.recall``): R archived frames older
  than the budget read back from host memory each chunk, as its queries choose.

Also measured: the dense run's PSNR / SSIM along a whole flight, the share of the attention mass the
dense cache's queries put on the history (the cache, not their own chunk) on the revisited chunks, AnnSA's
density, and every setting's ms per chunk, side by side in one process (rounds taking turns; the mean
chunk of the N = 384 flight's second half, where every bounded cache is full, then the median over
rounds; CUDA graphs on, as the rollout runs: a chunk whose graph key changed is captured anew, and the
mean counts it). PSNR peaks at the frames' full range [-1, 1].

    python bench/world_eval.py                    # on the GPU: bench/results/world_eval.json + .png
    python bench/world_eval.py --smoke            # a few settings at N = 48 on the CPU
"""
from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, write_json  # noqa: E402
from common.testbed import ssim  # noqa: E402
importlib.import_module(f"{fastar.__name__}.photo_world")  # fastar.photo_world: the package leaves it out

NS = (48, 96, 192, 384)


class OwnChunk(fastar.attention.FastARAttention):
    """No history: every query reads its own chunk alone (the cache is still written)."""

    def self_attention(self, layer, q, k, v):
        self.cache.attend(layer, k, v)
        return self.backend.attend(q, k, v)


class HistoryMass(fastar.attention.FastARAttention):
    """The dense cache's attention, recording per denoising call the share of each query's attention
    mass on keys outside its own chunk (mean over queries and heads), per layer."""
    graph_safe = False

    def __init__(self, cache, **kw):
        super().__init__(cache, **kw)
        self.shares: list[tuple[int, float]] = []  # (first frame of the chunk, share)

    def self_attention(self, layer, q, k, v):
        if not self.cache.clean_pass:
            keys, _, _ = self.cache.attend(layer, k, v)
            span = self.cache.layout.chunk
            logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys.float()) / q.shape[-1] ** 0.5
            p = logits.softmax(-1)
            own = p[..., span.start:span.stop].sum(-1)
            self.shares.append((self.cache.frames_cached, (1 - own).mean().item()))
        return super().self_attention(layer, q, k, v)


def settings(smoke: bool, thresholds: list[float], sweep: list[float]) -> dict:
    """name -> (cache config, AnnConfig or None, attention class or None)."""
    C, T = fastar.config.CacheConfig, fastar.config.TempCacheConfig
    out = {"dense": (C(), None, None), "own chunk": (C(), None, OwnChunk)}
    sizes = (15,) if smoke else (6, 9, 12, 15, 21)
    # windows up to TempCache's cost: its merge is a fixed cost per chunk, large against these small shapes
    for w in sizes + (() if smoke else (27, 33, 39, 45)):
        out[f"window {w}"] = (C("window", sink_frames=3, window_frames=w - 3), None, None)
    for t in thresholds:
        for b in sizes:
            out[f"tempcache {b} @ {t}"] = (T(merge_threshold=t, max_cache_frames=b), None, None)
        for b in sizes[-2:]:  # AnnSA runs from a 15-frame budget on (shorter, it stands aside)
            out[f"tempcache {b} @ {t} + AnnSA"] = (T(merge_threshold=t, max_cache_frames=b), fastar.config.AnnConfig(),
                                                   None)
    for t in sweep:
        out[f"tempcache 12 @ {t}"] = (T(merge_threshold=t), None, None)
    for r in (6,) if smoke else (3, 6, 9):  # the memory tier beside the default budget
        out[f"tempcache 12 @ 0.8 + recall {r}"] = (T(recall_frames=r), None, None)
    return out


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (10 * torch.log10(4 / (x.float() - ref.float()).pow(2).mean())).item()


def flights(spec, n: int, photos: list[str], device) -> list:
    out = []
    for i, path in enumerate(photos):
        photo = fastar.photo_world.load_photo(path, device)
        r = fastar.photo_world.revisit_actions(spec.actions, n, tuple(photo.shape[1:]), spec.view,
                                               np.random.default_rng([n, i]))
        out.append(fastar.photo_world.flight(photo, r.actions, spec.view, r.lead_in + 12,
                                             np.random.default_rng([n, i, 1]), r.revisit))
    return out


def fly(model, f, setting, on_chunk=None, cuda_graphs=True):
    cache, ann, attention = setting
    with torch.inference_mode():
        ro = fastar.photo_world.flight_rollout(model, f, cache=cache, ann=ann, cuda_graphs=cuda_graphs)
        if attention is not None:  # a control: another attention over the rollout's cache
            ro.attention = attention(ro.cache)
        return model.spec.decode(ro.run(on_chunk).float()).clamp(-1, 1)


def quality(model, spec, ns, photos, table, device, done=lambda rows, curve: None) -> tuple[list[dict], dict]:
    """Revisit PSNR / SSIM against the truth and against dense per (N, setting, photo); the dense
    flight's per-frame curve at N = 96 (or the first N) on the first photograph; AnnSA's density.
    ``done(rows, curve)`` after each N."""
    rows, curve = [], {}
    for n in ns:
        done(rows, curve)
        for i, f in enumerate(flights(spec, n, photos, device)):
            rv = list(f.revisit)
            dense = None
            for name, setting in table.items():
                densities = []
                tic = time.time()
                video = fly(model, f, setting, lambda r: densities.append(r.annsa_density)
                            if r.annsa_densities is not None else None)
                if name == "dense":
                    dense = video
                    if i == 0 and (n == 96 or not curve):
                        curve = {"n": n, "photo": os.path.basename(photos[i]), "observed": f.observed,
                                 "revisit": [rv[0], rv[-1]],
                                 "psnr": [psnr(video[:, :, j], f.truth[:, :, j]) for j in range(video.shape[2])],
                                 "ssim": [ssim(video[:, :, j:j + 1], f.truth[:, :, j:j + 1])
                                          for j in range(video.shape[2])]}
                row = {"n": n, "photo": os.path.basename(photos[i]), "setting": name,
                       "psnr_truth": psnr(video[:, :, rv], f.truth[:, :, rv]),
                       "ssim_truth": ssim(video[:, :, rv], f.truth[:, :, rv]),
                       "psnr_dense": psnr(video[:, :, rv], dense[:, :, rv]) if name != "dense" else None,
                       "psnr_truth_all_sampled": psnr(video[:, :, f.observed:], f.truth[:, :, f.observed:])}
                if densities:
                    row["annsa_density"] = statistics.mean(densities)
                rows.append(row)
                print(f"N {n:3d} {row['photo']:20s} {name:28s} revisit {row['psnr_truth']:6.2f} dB vs truth"
                      + (f", {row['psnr_dense']:6.2f} vs dense" if row["psnr_dense"] is not None else "")
                      + (f", AnnSA reads {row['annsa_density']:.0%}" if densities else "")
                      + f"  ({time.time() - tic:.1f} s)", flush=True)
    return rows, curve


def history_mass(model, spec, ns, photos, device) -> list[dict]:
    """The share of the dense cache's attention mass on the history, over the chunks that make the
    revisit and over all sampled chunks."""
    out = []
    for n in ns:
        for i, f in enumerate(flights(spec, n, photos, device)):
            probe = {}

            def attention(cache):
                probe["a"] = HistoryMass(cache)
                return probe["a"]

            fly(model, f, (fastar.config.CacheConfig(), None, attention), cuda_graphs=False)
            first = f.revisit.start // spec.frames_per_latent // 3 * 3  # the revisit's first chunk's first frame
            shares = probe["a"].shares
            out.append({"n": n, "photo": os.path.basename(photos[i]),
                        "revisit": statistics.mean(s for frame, s in shares if frame >= first),
                        "all": statistics.mean(s for _, s in shares)})
            print(f"N {n:3d} {out[-1]['photo']:20s} history holds {out[-1]['revisit']:.1%} of the attention on the "
                  f"revisit, {out[-1]['all']:.1%} over the sampled chunks", flush=True)
    return out


def timing(model, spec, table, photo, n, rounds, device) -> dict:
    """ms per chunk of every setting on one flight, side by side: rounds take turns over the settings."""
    f = flights(spec, n, [photo], device)[0]
    times = {name: [] for name in table if name != "own chunk"}
    chunks = {}
    for _ in range(rounds):
        for name in times:
            lat = []
            fly(model, f, table[name], lambda r: lat.append(1e3 * r.latency_s))
            times[name].append(statistics.mean(lat[len(lat) // 2:]))
            chunks[name] = [round(x, 3) for x in lat]
    return {name: {"ms": statistics.median(t), "rounds": t, "last_round_chunks_ms": chunks[name]}
            for name, t in times.items()}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["n"] for r in result["quality"]})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    axes = axes.flatten()
    ms = {k: v["ms"] for k, v in result["timing"].items()}
    colours = dict(zip(result["thresholds"], ("tab:orange", "tab:green", "tab:red", "tab:purple")))
    for ax, n in zip(axes, ns):
        mean = {}
        for r in result["quality"]:
            if r["n"] == n:
                mean.setdefault(r["setting"], []).append(r["psnr_truth"])
        mean = {k: statistics.mean(v) for k, v in mean.items()}
        pts = sorted((ms[k], mean[k]) for k in mean if k.startswith("window"))
        ax.plot(*zip(*pts), marker="o", color="tab:blue", label="sink 3 + window (6-45 frames)")
        for t, colour in colours.items():
            pts = sorted((ms[k], mean[k]) for k in mean if k.endswith(f"@ {t}"))
            ax.plot(*zip(*pts), marker="s", color=colour, label=f"TempCache, threshold {t} (6-21 frames)")
            for k in mean:
                if k.endswith(f"@ {t} + AnnSA"):
                    ax.scatter([ms[k]], [mean[k]], marker="*", s=110, color=colour, edgecolor="k", zorder=3,
                               label=f"+ AnnSA (15, 21 frames), {t}" if "15" in k else None)
        pts = sorted((ms[k], mean[k]) for k in mean if "+ recall" in k)
        if pts:
            ax.plot(*zip(*pts), marker="D", color="tab:brown", label="TempCache 12 + recall (its memory tier)")
        ax.axhline(mean["dense"], color="k", ls="--", lw=1, label=f"dense cache ({ms['dense']:.0f} ms a chunk)")
        ax.axhline(mean["own chunk"], color="grey", ls=":", lw=1, label="no history (own chunk)")
        ax.set_xscale("log")
        ax.set(title=f"revisit after N = {n} video frames", xlabel="ms per chunk (log)",
               ylabel="revisit PSNR vs truth (dB)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    c = result["curve"]
    ax = axes[4]
    ax.plot(c["psnr"], lw=1)
    ax.axvspan(0, c["observed"], color="grey", alpha=0.15, label="observed (ground truth)")
    ax.axvspan(c["revisit"][0], c["revisit"][1], color="tab:green", alpha=0.2, label="revisit")
    ax.set_ylim(8, 40)
    ax.set(title=f"dense cache along one flight (N = {c['n']}, {c['photo']})", xlabel="video frame",
           ylabel="PSNR vs truth (dB)")
    ax.legend(fontsize=7)
    ax = axes[5]
    mass = result["history_mass"]
    for key, label in (("revisit", "on the revisit's chunks"), ("all", "over every sampled chunk")):
        ax.plot(range(len(ns)), [statistics.mean(m[key] for m in mass if m["n"] == n) for n in ns], marker="o",
                label=label)
    ax.set(title="attention mass on the history (dense cache)", xlabel="N (video frames)", ylabel="share", ylim=(0, 1))
    ax.set_xticks(range(len(ns)), [str(n) for n in ns])
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"The trained world model ({result['model']}) on 3 held-out photographs, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--model", default=fastar.photo_world.WEIGHTS)
    p.add_argument("--n", default=",".join(map(str, NS)), help="revisit distances in video frames")
    p.add_argument("--thresholds", default="0.95,0.8", help="TempCache merge thresholds run at every budget")
    p.add_argument("--sweep", default="0.9,0.85,0.7", help="more thresholds, at budget 12")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds")
    p.add_argument("--timing-n", type=int, default=384, help="the flight timed")
    p.add_argument("--settings", help="only these of the table's settings (comma-separated names; dense first), "
                                      "their revisit PSNR alone (no timing, no history mass): world_eval_settings.json")
    p.add_argument("--cpu", action="store_true", help="on the CPU in fp32 (what --smoke runs on)")
    args = p.parse_args(argv)
    cpu = args.smoke or args.cpu
    device = torch.device("cpu" if cpu else "cuda")
    model = fastar.models.load_wan(args.model, device=device, dtype=torch.float32 if cpu else torch.bfloat16)
    spec = model.spec
    photos = sorted(os.path.join(fastar.photo_world.PHOTOS, "heldout", f)
                    for f in os.listdir(os.path.join(fastar.photo_world.PHOTOS, "heldout")))
    ns = [48] if args.smoke else [int(x) for x in args.n.split(",")]
    thresholds = [float(x) for x in args.thresholds.split(",")]
    table = settings(args.smoke, thresholds[:1] if args.smoke else thresholds,
                     [] if args.smoke else [float(x) for x in args.sweep.split(",") if x])
    if args.smoke:
        photos = photos[:1]
    if args.settings:
        chosen = args.settings.split(",")
        unknown = [s for s in chosen if s not in table]
        if unknown or chosen[0] != "dense":
            p.error(f"--settings: dense first, then any of {', '.join(table)}; unknown: {', '.join(unknown)}")
        table = {s: table[s] for s in chosen}
    tic = time.time()
    result = {**header(device, argv), "model": os.path.basename(args.model), "dtype": str(model.dtype),
              "thresholds": thresholds, "settings": list(table)}
    if not args.settings:  # a few settings: their quality alone
        result["timing"] = timing(model, spec, table, photos[0], 48 if args.smoke else args.timing_n,
                                  1 if args.smoke else args.rounds, device)
        for name, t in result["timing"].items():
            print(f"{name:28s} {t['ms']:7.2f} ms a chunk (rounds {', '.join(f'{x:.2f}' for x in t['rounds'])})")
        result["history_mass"] = history_mass(model, spec, ns, photos, device)
    name = "world_eval_settings" if args.settings else "world_eval_smoke" if args.smoke else "world_eval"

    def done(rows, curve):  # what is measured so far, should a later N not finish
        write_json(args.out, name + ".json", {**result, "quality": rows, "curve": curve,
                                               "minutes": round((time.time() - tic) / 60, 2)})

    result["quality"], result["curve"] = quality(model, spec, ns, photos, table, device, done)
    result["minutes"] = round((time.time() - tic) / 60, 2)
    print(f"wrote {write_json(args.out, name + '.json', result)}")
    if not args.settings:  # the plot places each setting by its time
        plot(result, os.path.join(args.out, name + ".png"))


if __name__ == "__main__":
    main()
