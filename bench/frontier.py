"""Speed against fidelity at two horizons: the sink 3 + window W cache, TempCache's budget B alone, and all of
FAST-AR (TempCache B with AnnSA's top-p mass 0.95 / 0.9, each with the dense first step and without), each per
chunk at steady state against PSNR / SSIM after 81 and after 240 real cached frames.

  grid      windows W in 6 / 12 / 21 / 36 / 60 (sink 3); TempCache budgets B in 12 / 15 / 21 / 42 / 81 frames, alone
            and with AnnSA (keep_mass 0.95 / 0.9 over the 0.2 floor, ``dense_steps_fraction`` 0.3 / 0); with
            ``--fp8 linears`` every setting also has a twin whose blocks' linear layers run as fp8 GEMMs
            (``fastar.models.fp8_linears``; attention stays bf16: 8 bits lost to cuDNN there, bench/NOTES.md).
  speed     ms per chunk of a rollout just long enough that its cache is full for its last 5 chunks (frames
            held: sink + window or the budget, 3 a chunk: window 60 runs 26 chunks, B 81 32), the median of
            those 5 (common.rollouts.steady_state); AnnSA's density. Dense is the reference, not timed here.
  fidelity  e2e_bench's table: the testbed caches the real clip (bench/common/realvideo.py) for 81 / 240 frames, then
            generates 2 chunks; PSNR / SSIM against dense bf16, the share of the dense cache held, AnnSA's
            recall and density on layers 9 / 19. Per horizon the own-chunk control; the bf16 noise floor (dense
            fp32) at 81 only (at 240 fp32 K/V of 246 frames, 142 GB, do not fit beside the models: null and a
            note). The settings that differ only in the dense first step share one cached history (the clean
            pass runs sparse in both), and one pass to 240 frames serves both horizons (common.rollouts.Fidelity).
  derived   per horizon the Pareto front (not dominated on ms lower, PSNR higher); for each window the fastest
            TempCache / FAST-AR setting of its precision at least as fast and scoring higher after 240 frames.

Writes frontier.json after every group of settings (``"complete"`` once every setting of the grid is in it and
the run finished: a run cut short keeps what it measured; ``--replot frontier.json`` draws it), frontier.png at the
end (PSNR against ms per chunk, one panel per horizon, the Pareto front, the noise floor and the own-chunk control)
and a table. ``--only`` takes setting-name prefixes (window, tempcache21, fastar81, ...), ``--budgets`` other
TempCache budgets (13, 14: between two whole numbers of chunks), ``--merge`` keeps the
settings of the --out folder's frontier.json this run does not measure (a run in parts), ``--twins-only`` measures
the fp8 twins alone, ``--horizons`` other horizons.

    python bench/frontier.py --out bench/results               # ~12 minutes on an H200 (estimate), or in two parts:
    python bench/frontier.py --out bench/results --only window,tempcache12,tempcache21,tempcache42,fastar12,fastar21,fastar42
    python bench/frontier.py --out bench/results --only tempcache81,fastar81 --floor-horizons "" --merge   # ~8 + ~5
    python bench/frontier.py --fp8 linears --twins-only --floor-horizons "" --merge --out bench/results   # fp8: ~11,
                                                               # in two parts as above (add --only the same way)
    python bench/frontier.py --smoke --out /tmp                # tiny model on the CPU: checks the script only

The minutes are estimates (``estimate_s``) from the per-chunk costs in bench/results/frontier.json and
e2e_bench.json (FAST-AR at budgets 21 and 12, sink + window 12, TempCache alone at 21, dense at 81 / 240 frames,
the clean pass in bench/NOTES.md); fp8 twins are counted at bf16's cost. The script prints its estimate of the run
it is asked for before it starts (--smoke: the full run's) and every setting's wall time as it goes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SENSITIVE, fastar, header, parser, random_prompt, shapes, testbed_model, write_json  # noqa: E402
from common.rollouts import Fidelity, chunks_for, real_rollout, sharing, steady_state  # noqa: E402
from common.testbed import CHUNK, prompt_context, testbed  # noqa: E402

SINK = 3
GRID = {"windows": (6, 12, 21, 36, 60), "budgets": (12, 15, 21, 42, 81), "masses": (0.95, 0.9), "horizons": "81,240",
        "floor": "81"}
SMOKE = {"windows": (3, 6), "budgets": (6, 12), "masses": (0.95, 0.9), "horizons": "9,15", "floor": "9"}
PRECISIONS = {"none": (), "linears": (("+fp8", "fp8-linears"),)}  # name suffix, label
GEN_FRAMES = 2 * CHUNK


def _mass(m: float) -> str:
    return f"{m:g}".lstrip("0")


def grid(g: dict, fp8: str, fp8_model=None) -> tuple[dict, dict]:
    """(settings, meta): name -> (cache, ann, Rollout options) as common.rollouts.make_run takes them, "dense" the
    reference; name -> family, precision and the frames its cache holds when full."""
    A, T = fastar.AnnConfig, fastar.TempCacheConfig
    base = []
    for w in g["windows"]:
        base.append((f"window{w}", "window", fastar.CacheConfig("window", SINK, w), None, SINK + w))
    for b in g["budgets"]:
        base.append((f"tempcache{b}", "tempcache", T(max_cache_frames=b), None, b))
        for m in g["masses"]:
            for ds, tag in ((0.3, ""), (0.0, "-nodense")):
                base.append((f"fastar{b}-p{_mass(m)}{tag}", "fastar", T(max_cache_frames=b),
                             A(keep_mass=m, dense_steps_fraction=ds), b))
    settings = {"dense": (fastar.CacheConfig("unbounded"), None, {})}
    meta = {}
    for name, family, cache, ann, held in base:
        settings[name] = (cache, ann, {})
        meta[name] = {"family": family, "precision": "bf16", "held_frames": held}
        for suffix, precision in PRECISIONS[fp8]:
            options = {"model": fp8_model}
            settings[name + suffix] = (cache, ann, options)
            meta[name + suffix] = {"family": family, "precision": precision, "held_frames": held}
    return settings, meta


# -- the cost of a run on an H200, from the committed results ---------------------------------------------------
def steady_ms(meta: dict, ann) -> float:
    """A steady chunk on an H200 (bf16), fitted to bench/results: a window 145 + 11.25 ms a frame attended (349
    at window 12); TempCache alone 195 + 13.7 ms a frame (524 at 21); FAST-AR 195 + 250 ms of attention at 21
    frames scaled by (frames / 24)^0.8, x0.95 at mass 0.9, x0.92 of it all without the dense first step (445,
    423 and 411 ms at 21; 341 and 308 at 12)."""
    f = meta["held_frames"] + CHUNK
    if meta["family"] == "window":
        return 145 + 11.25 * f
    if ann is None:
        return 195 + 13.7 * f
    ms = 195 + 250 * (f / 24) ** 0.8 * (0.95 if ann.keep_mass < 0.95 else 1.0)
    return ms * (0.92 if ann.dense_steps_fraction == 0 else 1.0)


def dense_pass_ms(frames: int) -> float:
    """One dense bf16 forward over ``frames`` cached frames (DESIGN.md: 16 ms of linears, 7.2 ms a layer at 81)."""
    return 16 + 2.55 * (frames + CHUNK)


def estimate_s(settings: dict, meta: dict, horizons: list, floor: set, extra: int) -> dict:
    """Seconds an H200 would take for a run of ``meta``'s settings, by part (fp8 twins counted at bf16 cost)."""
    last = max(horizons)
    groups = {}
    for name in meta:
        groups.setdefault(sharing(settings, name), []).append(name)
    groups = list(groups.values())
    ref = sum(sum(dense_pass_ms(f) for f in range(0, h, CHUNK)) + 2 * 5 * dense_pass_ms(h) for h in horizons) / 1e3
    own = sum(h / CHUNK * 20 + 2 * 5 * 20 for h in horizons) / 1e3
    fp32 = 8 * sum(sum(dense_pass_ms(f) for f in range(0, h, CHUNK)) + 2 * 5 * dense_pass_ms(h)
                   for h in horizons if h in floor) / 1e3
    timed = sum(chunks_for(meta[n]["held_frames"], extra) * steady_ms(meta[n], settings[n][1]) for n in meta) / 1e3
    history = gens = 0.0
    for names in groups:
        ms = steady_ms(meta[names[0]], settings[names[0]][1])
        per_pass = ms / 5 + (40 if meta[names[0]]["family"] != "window" else 0)
        history += last / CHUNK * per_pass / 1e3
        gens += len(names) * len(horizons) * GEN_FRAMES / CHUNK * 1.5 * ms / 1e3
    parts = {"startup": 40.0, "references": ref + own + fp32, "timed_rollouts": timed, "histories": history,
             "generations": gens}
    parts["total"] = sum(parts.values())
    return {k: round(v) for k, v in parts.items()}


# -- what the results say --------------------------------------------------------------------------------------
def pareto(rows: list, horizon: str) -> list:
    """Names of the rows with a time and a PSNR at ``horizon`` that no other row beats on both (ms lower or
    equal, PSNR higher or equal, one strictly)."""
    pts = [(r["ms"], r["fidelity"][horizon]["psnr"], r["name"]) for r in rows
           if r.get("ms") is not None and horizon in r.get("fidelity", {})]
    return [n for ms, p, n in sorted(pts)
            if not any(m2 <= ms and p2 >= p and (m2 < ms or p2 > p) for m2, p2, _ in pts)]


def windows_beaten(rows: list, horizon: str) -> dict:
    """Per window point, the fastest TempCache / FAST-AR row of its precision at least as fast whose PSNR at
    ``horizon`` is higher; None where no row is."""
    out = {}
    for w in rows:
        if w["family"] != "window" or w.get("ms") is None or horizon not in w.get("fidelity", {}):
            continue
        better = [r for r in rows if r["family"] != "window" and r["precision"] == w["precision"]
                  and r.get("ms") is not None and horizon in r.get("fidelity", {}) and r["ms"] <= w["ms"]
                  and r["fidelity"][horizon]["psnr"] > w["fidelity"][horizon]["psnr"]]
        out[w["name"]] = min(better, key=lambda r: r["ms"])["name"] if better else None
    return out


def derive(result: dict) -> None:
    rows, hs = result["settings"], [str(h) for h in result["horizons"]]
    result["pareto"] = {h: pareto(rows, h) for h in hs}
    last = hs[-1]
    result["windows_beaten"] = {"horizon": int(last), "rule": "the fastest TempCache / FAST-AR setting of the same "
                                "precision with ms <= the window's and a higher PSNR", "by": windows_beaten(rows, last)}


def plain(config) -> dict | None:
    """A config as JSON values, its kind named."""
    if config is None:
        return None
    kind = {"CacheConfig": "frames", "TempCacheConfig": "tempcache", "AnnConfig": "ann"}[type(config).__name__]
    return {"kind": kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}}


# -- output ----------------------------------------------------------------------------------------------------
MARKERS = {"bf16": "o", "fp8-linears": "v"}
COLORS = {"window": "C0", "tempcache": "C1", "fastar": "C2", "fastar-nodense": "C3"}


def _label(r: dict) -> str:
    if r["family"] == "window":
        return f"W{r['cache']['window_frames']}"
    text = f"B{r['cache']['max_cache_frames']}"
    if r["ann"] is not None:
        text += f" {_mass(r['ann']['keep_mass'])}" + (" nd" if r["ann"]["dense_steps_fraction"] == 0 else "")
    return text


def _color(r: dict) -> str:
    if r["family"] == "fastar" and r["ann"]["dense_steps_fraction"] == 0:
        return COLORS["fastar-nodense"]
    return COLORS[r["family"]]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = [str(h) for h in result["horizons"]]
    fig, axes = plt.subplots(1, len(hs), figsize=(7 * len(hs), 5.6), squeeze=False)
    rows = [r for r in result["settings"] if r.get("ms") is not None]
    for ax, h in zip(axes[0], hs):
        have = [r for r in rows if h in r.get("fidelity", {})]
        for precision in dict.fromkeys(r["precision"] for r in have):
            marker = MARKERS.get(precision, "s")
            win = sorted((r for r in have if r["family"] == "window" and r["precision"] == precision),
                         key=lambda r: r["cache"]["window_frames"])
            if win:
                ax.plot([r["ms"] for r in win], [r["fidelity"][h]["psnr"] for r in win], "-", marker=marker,
                        color=COLORS["window"], label=f"sink 3 + window ({precision})")
            for family, label in (("tempcache", "TempCache alone"), ("fastar", "FAST-AR, dense first step"),
                                  ("fastar-nodense", "FAST-AR, no dense step")):
                pts = [r for r in have if r["family"] != "window" and r["precision"] == precision
                       and _color(r) == COLORS[family]]
                if pts:
                    ax.scatter([r["ms"] for r in pts], [r["fidelity"][h]["psnr"] for r in pts], marker=marker,
                               color=COLORS[family], s=30, label=f"{label} ({precision})", zorder=3)
        for r in have:
            ax.annotate(_label(r), (r["ms"], r["fidelity"][h]["psnr"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        front = [next(r for r in have if r["name"] == n) for n in result["pareto"].get(h, [])]
        if front:
            ax.step([r["ms"] for r in front], [r["fidelity"][h]["psnr"] for r in front], where="post", color="0.5",
                    ls="--", lw=1, label="Pareto front", zorder=1)
        ref = result["references"].get(h, {})
        if ref.get("noise_floor"):
            ax.axhline(ref["noise_floor"]["psnr"], color="k", ls=":", lw=1,
                       label=f"bf16 noise floor (dense fp32) {ref['noise_floor']['psnr']:.1f} dB")
        if ref.get("own_chunk_only"):
            ax.axhline(ref["own_chunk_only"]["psnr"], color="r", ls=":", lw=1,
                       label=f"own chunk only {ref['own_chunk_only']['psnr']:.1f} dB")
        ax.set(xlabel="ms per chunk at steady state (3 latent frames, 4 steps + the clean pass)",
               ylabel="PSNR against dense bf16 (dB)", title=f"after {h} real cached frames, then 2 chunks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.suptitle(f"Speed against fidelity: Wan 2.1 {result['shapes']['model']} shapes "
                 f"{result['shapes']['height']}x{result['shapes']['width']}, random weights (sensitized), "
                 f"{result['device']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict) -> None:
    hs = [str(h) for h in result["horizons"]]
    head = f"{'setting':26s} {'precision':>13s} {'chunks':>6s} {'ms':>8s} {'dens':>5s}" + "".join(
        f" | {h + ' fr: PSNR':>12s} {'SSIM':>6s} {'held':>5s} {'recall':>6s}" for h in hs) + f" | {'wall s':>7s}"
    print(head)
    print("-" * len(head))
    for h in hs:
        ref = result["references"].get(h)
        if ref:
            floor = ref["noise_floor"]
            print(f"  after {h} frames: noise floor " + (f"{floor['psnr']:.1f} dB / {floor['ssim']:.4f}" if floor
                                                        else "not measured")
                  + f", own chunk only {ref['own_chunk_only']['psnr']:.1f} dB / {ref['own_chunk_only']['ssim']:.4f}")
    for r in result["settings"]:
        line = (f"{r['name']:26s} {r['precision']:>13s} {r.get('chunks', 0):6d} {r.get('ms') or float('nan'):8.1f} "
                f"{r.get('density', float('nan')):5.2f}")
        for h in hs:
            f = r.get("fidelity", {}).get(h)
            line += (f" | {f['psnr']:12.1f} {f['ssim']:6.4f} {f['kv_held']:5.2f} {f.get('annsa_recall', float('nan')):6.3f}"
                     if f else " | " + " " * 32)
        print(line + f" | {sum(r.get('wall_s', {}).values()):7.1f}")
    for h in hs:
        print(f"Pareto front after {h} frames: {', '.join(result['pareto'].get(h, []))}")
    beaten = result.get("windows_beaten", {})
    for w, by in beaten.get("by", {}).items():
        print(f"  {w}: {'beaten by ' + by if by else 'not beaten'} after {beaten['horizon']} frames")


# -- the run ---------------------------------------------------------------------------------------------------
def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("--horizons", help=f"real cached frames before each fidelity's generation (default "
                    f"{GRID['horizons']}; --smoke {SMOKE['horizons']})")
    ap.add_argument("--floor-horizons", help=f"horizons with the fp32 noise floor (default {GRID['floor']}; "
                    f"--smoke {SMOKE['floor']})")
    ap.add_argument("--only", help="comma-separated setting-name prefixes (window, tempcache, fastar21, ...)")
    ap.add_argument("--budgets", help=f"TempCache budgets in frames, comma-separated (default "
                    f"{','.join(map(str, GRID['budgets']))}): any above the sink and a chunk, a whole number of chunks or not")
    ap.add_argument("--fp8", choices=tuple(PRECISIONS), default="none",
                    help="add a twin of every setting with the blocks' linears as fp8 GEMMs")
    ap.add_argument("--twins-only", action="store_true",
                    help="only the fp8 twins (with --merge: the precision axis added to a bf16 run's file)")
    ap.add_argument("--extra-chunks", type=int, default=0, help="chunks timed beyond the full cache's 5")
    ap.add_argument("--merge", action="store_true",
                    help="keep the settings of the --out folder's frontier.json this run does not measure (a run in parts)")
    ap.add_argument("--replot", metavar="JSON", help="draw and print a frontier.json (a run's, complete or not)")
    ap.add_argument("--prompt", choices=("random", "wan"), default="random",
                    help="the Gaussian stand-in or the clip's real prompt, for speed and fidelity (-> frontier_wan.json)")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        derive(result)
        plot(result, os.path.splitext(args.replot)[0] + ".png")
        print_table(result)
        return
    g = dict(SMOKE if args.smoke else GRID)
    if args.budgets:
        g["budgets"] = tuple(int(b) for b in args.budgets.split(","))
    horizons = sorted(int(h) for h in (args.horizons or g["horizons"]).split(","))
    floor = {int(h) for h in (g["floor"] if args.floor_horizons is None else args.floor_horizons).split(",") if h}
    floor &= set(horizons)
    device, size, hw = shapes(args.smoke)
    tic = time.time()
    model, ctx = testbed(size=size, device=str(device), prompt=args.prompt)
    fp8_model = fastar.models.fp8_linears(model) if args.fp8 == "linears" else None
    settings, meta = grid(g, args.fp8, fp8_model)
    if args.twins_only:
        if args.fp8 == "none":
            ap.error("--twins-only needs --fp8 linears")
        meta = {n: m for n, m in meta.items() if m["precision"] != "bf16"}
    if args.only:
        prefixes = tuple(p for p in args.only.split(",") if p)
        meta = {n: m for n, m in meta.items() if n.startswith(prefixes)}
        if not meta:
            ap.error(f"--only {args.only}: no setting starts so; they are {', '.join(grid(g, args.fp8)[1])}")
    settings = {n: s for n, s in settings.items() if n == "dense" or n in meta}
    model32 = testbed_model(fastar, size, device, torch.float32) if floor else None
    ctx32 = (prompt_context(model.context_dim, device=device) if args.prompt == "wan"  # the fp32 testbed's
             else random_prompt(model.context_dim, device, torch.float32))
    fid = Fidelity(model, model32, ctx32.to(model.dtype), horizons, hw, GEN_FRAMES, settings, floor)
    groups = fid.groups()
    print(f"{len(meta)} settings in {len(groups)} cached histories; timed chunks: "
          + ", ".join(f"{n} {chunks_for(m['held_frames'], args.extra_chunks)}" for n, m in meta.items()), flush=True)
    if args.smoke:  # what the full grid would cost, with the same --fp8
        full, full_meta = grid(GRID, args.fp8)
        estimate = estimate_s(full, full_meta, sorted(int(h) for h in GRID["horizons"].split(",")),
                              {int(GRID["floor"])}, args.extra_chunks)
        print(f"the full run (--fp8 {args.fp8}) on an H200, estimated: {estimate['total'] / 60:.1f} minutes "
              f"({estimate})", flush=True)
    else:
        estimate = estimate_s(settings, meta, horizons, floor, args.extra_chunks)
        print(f"this run on an H200, estimated: {estimate['total'] / 60:.1f} minutes ({estimate})", flush=True)

    out_name = "frontier" + ("_wan" if args.prompt == "wan" else "") + ("_smoke" if args.smoke else "") + ".json"
    earlier = None
    if args.merge and os.path.exists(os.path.join(args.out, out_name)):
        with open(os.path.join(args.out, out_name)) as f:
            earlier = json.load(f)
        if earlier.get("horizons") != horizons or earlier.get("device") != header(device)["device"]:
            ap.error(f"--merge: {os.path.join(args.out, out_name)} holds horizons {earlier.get('horizons')} on "
                     f"{earlier.get('device')}; this run measures {horizons} on {header(device)['device']}")
    this_run = {**{k: header(device)[k] for k in ("commit", "dirty", "command", "date")}, "settings": list(meta),
                "complete": False}
    result = {**header(device), "runs": (earlier or {}).get("runs", []) + [this_run], "complete": False,
              "shapes": {"height": hw[0], "width": hw[1], "chunk_frames": CHUNK, "model": size, "dtype": "bfloat16"},
              "testbed": {"sensitized": SENSITIVE, "weights": "random (no Wan weights exist here)",
                          "prompt": args.prompt, "video": "bench/common/realvideo.py's clips"},
              "horizons": horizons, "generated_frames": GEN_FRAMES, "fp8": args.fp8,
              "timing": "per chunk: the median of the last 5 chunks of a rollout whose cache is full for them; "
                        "CUDA graphs where chunks repeat (fastar.rollout)",
              "estimate_h200_s": estimate, "references": {}, "settings": []}
    rows = {}
    kept = {r["name"]: r for r in (earlier or {}).get("settings", []) if r["name"] not in meta}
    twins = [suffix for mode in PRECISIONS.values() for suffix, _ in mode]
    order = [n + t for n in grid(g, "none")[1] for t in ("", *twins)] + list(kept)  # fp8 twins beside their settings

    def save():
        merged = {**kept, **rows}
        result["settings"] = [merged[n] for n in dict.fromkeys(order) if n in merged]
        this_run["wall_s"] = round(time.time() - tic, 1)
        result["complete"] = this_run["complete"] and all(n in merged for n in grid(g, args.fp8)[1])
        derive(result)
        write_json(args.out, out_name, result)

    for precision in dict.fromkeys(m["precision"] for m in meta.values()):  # warm-up: Triton compiles, cuDNN plans
        first = next((n for n, m in meta.items() if m["precision"] == precision and m["family"] == "fastar"),
                     next(n for n, m in meta.items() if m["precision"] == precision))
        real_rollout(model, ctx, 2, hw, first, log_every=1000, settings=settings)
    print(f"[{time.time() - tic:.0f} s] models built, warmed up", flush=True)

    fid.references()
    fid.model32 = model32 = None  # the noise floor's model: not needed again
    for h in horizons:
        ref = result["references"][str(h)] = {k: v for k, v in fid.rows[h].items() if k not in settings}
        old = (earlier or {}).get("references", {}).get(str(h), {})
        if ref["noise_floor"] is None and old.get("noise_floor"):  # measured by an earlier run: kept
            ref.update(noise_floor=old["noise_floor"], noise_floor_note="measured by an earlier run of --merge")
    print(f"[{time.time() - tic:.0f} s] references done", flush=True)
    save()

    for names in groups:
        for name in names:
            t0 = time.time()
            chunks = chunks_for(meta[name]["held_frames"], args.extra_chunks)
            timed = steady_state(real_rollout(model, ctx, chunks, hw, name, log_every=1000, settings=settings))
            cache, ann, _ = settings[name]
            rows[name] = {"name": name, **meta[name], "cache": plain(cache), "ann": plain(ann), "chunks": chunks,
                          "steady_chunks": 5, **timed, "fidelity": {}, "wall_s": {"timed_rollout": round(time.time() - t0, 1)}}
            print(f"  {name}: {timed['ms']:.1f} ms a chunk over the last 5 of {chunks}, density "
                  f"{timed['density']:.3f} ({time.time() - t0:.1f} s)", flush=True)
        fid.measure(names)
        for name in names:
            rows[name]["fidelity"] = {str(h): fid.rows[h][name] for h in horizons}
            rows[name]["wall_s"]["fidelity"] = round(fid.walls[name], 1)
        save()
        print(f"[{time.time() - tic:.0f} s] {', '.join(names)} done", flush=True)

    this_run["complete"] = True
    save()
    png = os.path.join(args.out, os.path.splitext(out_name)[0] + ".png")
    plot(result, png)
    print_table(result)
    print(f"[{time.time() - tic:.0f} s] wrote {os.path.join(args.out, out_name)} and {png} "
          f"(estimate was {estimate['total']} s)")


if __name__ == "__main__":
    main()
