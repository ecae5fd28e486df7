"""A B A B: two revisions of the package timed side by side in one process, on one model.

A and B are each a git revision (exported with ``git archive`` into the git-ignored ``.scratch/ab/<commit>/``,
bench/ and tests/ left out) or a directory holding such a tree; B defaults to this working tree. They are
imported as the packages ``fastar_a`` and ``fastar_b`` (``common.load_package``) and driven through the
public API both have: ``fastar.Rollout(model, context, frames=, height=, width=, chunk_frames=, cache=, ann=)``.
Both run the same sensitized random-weight Wan 2.1 model (``common.testbed_model``, built by A, its weights
copied into B's model) on the same prompt (``--prompt``: the Gaussian stand-in or the clip's real one). For each setting, one untimed rollout per revision
(Triton compiles, cuDNN plans), then ``--repeats`` rounds of A then B, each a fresh rollout of ``--chunks``
chunks timed by its chunk reports; a rollout's time is the median of its last ``--steady`` chunks, where the
cache is full and repeating chunks replay from their CUDA graph. Settings: ``fastar``, the FAST-AR defaults
(``TempCacheConfig()`` with ``AnnConfig()``), ``window``, the dense sink 3 + window 12 cache, and
``tempcache`` / ``tempcache12`` / ``tempcache15``, TempCache alone at its default budget and at 12 / 15 frames,
``fastar12``, TempCache 12 with AnnSA, ``tempcache21`` / ``fastar21``, the same at 21 frames, and
``tempcache12recall6``, TempCache 12 with 6 frames of its memory tier (``fastar.recall``). Printed per
setting: A ms and B ms (medians over rounds), B/A (the median of each round's ratio: a drift of the clock
cancels within a round) and how far B's latents lie from A's (relative, last round). Writes ab.json.

    python bench/ab.py b79626b --out bench/results     # A = that commit, B = the working tree; ~3 min on an H200
    python bench/ab.py HEAD~1 HEAD                     # two commits (HEAD HEAD: the noise of the measurement)
    python bench/ab.py b79626b --export-only           # export only; then carry .scratch/ab to a machine without
    python bench/ab.py .scratch/ab/<commit>            #   git and name the exported tree there
    python bench/ab.py HEAD --smoke --out /tmp         # tiny model on the CPU: checks the script only
"""
from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, header, load_package, parser, random_prompt, shapes, testbed_model, write_json  # noqa: E402
from common.testbed import prompt_context  # noqa: E402

CHUNK = 3
EXPORTS = os.path.join(ROOT, ".scratch", "ab")
# name -> the Rollout settings in a revision's own config classes
SETTINGS = {
    "fastar": lambda f: {"cache": f.TempCacheConfig(), "ann": f.AnnConfig()},
    "window": lambda f: {"cache": f.CacheConfig("window", sink_frames=3, window_frames=12), "ann": None},
    "tempcache": lambda f: {"cache": f.TempCacheConfig(), "ann": None},
    "tempcache12": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=12), "ann": None},
    "tempcache15": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=15), "ann": None},
    "fastar12": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=12), "ann": f.AnnConfig()},
    "tempcache21": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=21), "ann": None},
    "fastar21": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=21), "ann": f.AnnConfig()},
    "tempcache12recall6": lambda f: {"cache": f.TempCacheConfig(max_cache_frames=12, recall_frames=6), "ann": None},
}


def git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def export(rev: str) -> tuple[str, str]:
    """The tree of git revision ``rev`` under .scratch/ab/<commit>/ (exported once); returns (folder, commit)."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    folder = os.path.join(EXPORTS, commit)
    if not os.path.isdir(folder):
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        archive = subprocess.Popen(["git", "-C", ROOT, "archive", commit, "--", ".", ":(exclude)bench",
                                    ":(exclude)tests"], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", partial], stdin=archive.stdout, check=True)
        if archive.wait():
            raise RuntimeError(f"git archive {commit} failed")
        with open(os.path.join(partial, "COMMIT"), "w") as f:
            f.write(commit + "\n")
        os.rename(partial, folder)
    return folder, commit


def digest(folder: str) -> str:
    """SHA-256 of the package's code in ``folder`` (every .py file under fastar/, kernels/, nodes/, by path):
    what ran, whatever a copied tree's git metadata says."""
    h = hashlib.sha256()
    for part in ("fastar", "kernels", "nodes"):
        for dirpath, _, files in sorted(os.walk(os.path.join(folder, part))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, folder).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()


def resolve(spec: str | None) -> tuple[str, str]:
    """(tree folder, what it is): the working tree for None, a folder as given, else a git revision exported."""
    if spec is None:
        try:
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
            return ROOT, git("rev-parse", "HEAD") + (" + uncommitted changes" if dirty else "")
        except (OSError, subprocess.CalledProcessError):
            return ROOT, "working tree"
    if os.path.isdir(spec):
        stamp = os.path.join(spec, "COMMIT")
        if not os.path.exists(stamp):
            return os.path.abspath(spec), "folder " + spec
        with open(stamp) as f:
            return os.path.abspath(spec), f.read().strip()
    try:
        return export(spec)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"ab.py: {spec!r} is neither a folder nor a git revision here ({exc}); where git is, run "
                         f"bench/ab.py {spec} --export-only and carry .scratch/ab") from exc


def held_frames(cache) -> int:
    """Frames the cache holds once full: TempCache's budget and recall rows, or the window's sink + window."""
    if hasattr(cache, "max_cache_frames"):
        return cache.max_cache_frames + getattr(cache, "recall_frames", 0)
    return cache.sink_frames + cache.window_frames


def rollout(package, model, context, setting, chunks, hw):
    """Each chunk's ms and the latents of one fresh rollout."""
    times = []
    run = package.Rollout(model, context, frames=chunks * CHUNK, height=hw[0], width=hw[1], chunk_frames=CHUNK,
                          **SETTINGS[setting](package))
    with torch.inference_mode():
        latents = run.run(lambda r: times.append(1e3 * r.latency_s))
    del run
    if context.device.type == "cuda":
        torch.cuda.empty_cache()
    return times, latents


def main():
    ap = parser(__doc__, smoke=True)
    ap.add_argument("a", help="revision A: a git revision or a folder holding an exported tree")
    ap.add_argument("b", nargs="?", help="revision B, as A (default: this working tree)")
    ap.add_argument("--settings", default="fastar,window",
                    help=f"comma-separated, of {', '.join(SETTINGS)} (default fastar,window)")
    ap.add_argument("--chunks", type=int, default=14, help="chunks per rollout (default 14)")
    ap.add_argument("--steady", type=int, default=5, help="last chunks of each rollout timed, at least 5 (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of A then B per setting (default 3)")
    ap.add_argument("--export-only", action="store_true", help="export the revisions and print their folders")
    ap.add_argument("--prompt", choices=("random", "wan"), default="random",
                    help="text context: the Gaussian stand-in, or the real clip's prompt (common.testbed.prompt_context); "
                         "wan writes ab_wan.json")
    args = ap.parse_args()
    names = args.settings.split(",")
    if any(n not in SETTINGS for n in names):
        ap.error(f"--settings: choose among {', '.join(SETTINGS)}")
    if args.smoke:
        args.chunks, args.steady, args.repeats = 10, 1, 2
    elif args.steady < 5:
        ap.error("--steady must be at least 5: a rollout's time is the median of its steady chunks")
    trees = {"a": resolve(args.a), "b": resolve(args.b)}
    for key, (folder, what) in trees.items():
        print(f"{key.upper()}: {what} ({folder})")
    if args.export_only:
        return

    packages = {key: load_package(f"fastar_{key}", folder) for key, (folder, _) in trees.items()}
    for name in names:
        full = max(-(-held_frames(SETTINGS[name](p)["cache"]) // CHUNK) for p in packages.values())
        if args.chunks - args.steady < full + 2:  # the cache full, then one chunk captured as a CUDA graph
            ap.error(f"{name}: the cache is full after {full} chunks; --chunks {args.chunks} leaves "
                     f"{args.chunks - args.steady} before the {args.steady} timed, at least {full + 2} are needed")
    device, size, hw = shapes(args.smoke)
    models = {"a": testbed_model(packages["a"], size, device)}
    models["b"] = packages["b"].models.build_model(size, device=device, dtype=models["a"].dtype)
    models["b"].load_state_dict(models["a"].state_dict())
    if args.prompt == "wan":
        context = prompt_context(models["b"].context_dim, device=device, dtype=models["a"].dtype)
    else:
        context = random_prompt(models["b"].context_dim, device, models["a"].dtype)

    result = {**header(device), **{key: {"tree": what, "code_sha256": digest(folder)} for key, (folder, what) in trees.items()},
              "shapes": {"model": size, "height": hw[0], "width": hw[1], "chunk_frames": CHUNK,
                         "dtype": str(models["a"].dtype).replace("torch.", "")},
              "weights": "bench/common.testbed_model (sensitized random weights), the same in A and B; "
                         + ("the clip's real prompt" if args.prompt == "wan" else "Gaussian prompt"), "chunks": args.chunks, "steady": args.steady, "repeats": args.repeats,
              "settings": {}}
    for name in names:
        for key in "ab":  # warm-up
            rollout(packages[key], models[key], context, name, args.chunks, hw)
        runs = {"a": [], "b": []}
        for _ in range(args.repeats):
            for key in "ab":
                times, latents = rollout(packages[key], models[key], context, name, args.chunks, hw)
                runs[key].append((times, latents))
        ms = {key: [statistics.median(t[-args.steady:]) for t, _ in runs[key]] for key in "ab"}
        ratios = [b / a for a, b in zip(ms["a"], ms["b"])]
        last_a, last_b = runs["a"][-1][1].float(), runs["b"][-1][1].float()
        result["settings"][name] = {
            "a": repr(SETTINGS[name](packages["a"])), "b": repr(SETTINGS[name](packages["b"])),
            "a_ms": statistics.median(ms["a"]), "b_ms": statistics.median(ms["b"]),
            "b_over_a": statistics.median(ratios), "a_ms_per_round": ms["a"], "b_ms_per_round": ms["b"],
            "b_over_a_per_round": ratios,
            "b_vs_a_latents_rel": ((last_b - last_a).norm() / last_a.norm()).item(),
            "a_chunk_ms": [[round(x, 1) for x in t] for t, _ in runs["a"]],
            "b_chunk_ms": [[round(x, 1) for x in t] for t, _ in runs["b"]]}
        print(f"{name}: A " + " ".join(f"{x:.1f}" for x in ms["a"]) + " ms, B " + " ".join(f"{x:.1f}" for x in ms["b"])
              + " ms", flush=True)

    print(f"\nA: {trees['a'][1]}\nB: {trees['b'][1]}\n{result['device']}, {size} at {hw[1]}x{hw[0]}, median of the "
          f"last {args.steady} of {args.chunks} chunks, {args.repeats} rounds of A then B")
    print(f"{'setting':10s} {'A ms':>9s} {'B ms':>9s} {'B/A':>7s}  {'B/A per round':24s} {'B vs A latents':>14s}")
    for name, row in result["settings"].items():
        rounds = " ".join(f"{r:.3f}" for r in row["b_over_a_per_round"])
        print(f"{name:10s} {row['a_ms']:9.1f} {row['b_ms']:9.1f} {row['b_over_a']:7.3f}  {rounds:24s} "
              f"{row['b_vs_a_latents_rel']:14.2e}")
    name = "ab_smoke.json" if args.smoke else "ab_wan.json" if args.prompt == "wan" else "ab.json"
    print("wrote", write_json(args.out, name, result))


if __name__ == "__main__":
    main()
