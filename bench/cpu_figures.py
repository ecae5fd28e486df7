"""The pack's CPU figures on the machine this runs on, under each thread setting, on a quiet machine and beside
one busy process (``python -c "while 1: pass"``, as on a machine shared with other work):

- ``fastar``, the main job, from start to end as a user times it (its own process: imports, the model's
  load, both flights, the GIF; wall seconds and the CPU seconds it used), and its world model's chunk under
  TempCache 12 (median of the last half, the cache full): what FAST-AR World Play plays a chunk at on a CPU,
  12 video frames a chunk;
- with ``--comfyui PATH``, the world template (``example_workflows/FAST-AR - world model, no download``)
  queued to a ComfyUI server on the CPU as the test queues it, from queue to its end (a new seed on both
  samplers each time, so nothing is cached).

Thread settings: ``torch`` (torch's default, a thread per core: ``fastar --threads 0``), ``omp1``
(``OMP_NUM_THREADS=1`` in the environment), ``set1`` (``torch.set_num_threads(1)``: ``fastar``'s default).
ComfyUI's server runs at torch's default or ``OMP_NUM_THREADS=1`` (``set1`` is the command line's).
Each figure is the median of ``--repeats`` runs, the settings taking turns; the load averages
(``/proc/loadavg``) before each run are recorded beside it, since other work on a shared machine changes
them. Writes ``cpu_figures.json``.

    python bench/cpu_figures.py                                   # ~15 minutes on a quiet 2-core machine
    python bench/cpu_figures.py --comfyui PATH                    # and the template (its Python: the pack's)
    python bench/cpu_figures.py --smoke --out /tmp                # one short run of each: checks the script
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, header, parser, write_json  # noqa: E402

SETTINGS = {"torch": ({}, ["--threads", "0"]), "omp1": ({"OMP_NUM_THREADS": "1"}, ["--threads", "0"]),
            "set1": ({}, ["--threads", "1"])}
LOADS = ("quiet", "busy")
WORLD_TEMPLATE = os.path.join(ROOT, "example_workflows",
                              "FAST-AR - world model, no download (TempCache against the window).json")
# the checkout's command line, whether or not it is installed
FASTAR = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from common import fastar; "
          "from comfyui_fastar.fastar.cli import main; sys.exit(main(sys.argv[1:]))")


def parse_args(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--repeats", type=int, default=3, help="runs of each setting and load (default 3)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"thread settings, of {', '.join(SETTINGS)}")
    p.add_argument("--loads", default=",".join(LOADS), help="quiet, busy (one busy process beside the run)")
    p.add_argument("--comfyui", help="a ComfyUI tree: also time the world template through its server")
    return p.parse_args(argv)


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def environment(extra: dict) -> dict:
    """This process's environment without a thread setting of its own, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TRITON_INTERPRET")}
    return {**env, **extra}


@contextlib.contextmanager
def load(kind: str):
    """``busy``: one process spinning on a core while the block runs; ``quiet``: none."""
    if kind == "quiet":
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        spin.kill()
        spin.wait()


def fastar_run(setting: str, smoke: bool) -> dict:
    """One ``fastar`` run: its wall seconds and TempCache 12's ms a chunk."""
    env, argv = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as out:
        args = [*argv, "--out", out] + (["--revisit", "36"] if smoke else [])
        before, cpu = loadavg(), resource.getrusage(resource.RUSAGE_CHILDREN)
        tic = time.perf_counter()
        subprocess.run([sys.executable, "-c", FASTAR, os.path.dirname(os.path.abspath(__file__)), *args],
                       env=environment(env), check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - tic
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        with open(os.path.join(out, "world.json")) as f:
            summary = json.load(f)
    chunk = next(c for name, c in summary["caches"].items() if name.startswith("TempCache"))
    return {"seconds": round(seconds, 2), "cpu_s": round(cpu_s, 2), "chunk_ms": round(chunk["ms_per_chunk"], 1),
            "loadavg": before}


def template_prompt(info: dict, seed: int, smoke: bool) -> dict:
    """The world template as the frontend queues it, both samplers' seed set to ``seed`` (new noise, nothing
    cached; the route is route_seed's); ``smoke``: a route of two chunks."""
    from comfyui_fastar.testing import comfy_harness

    with open(WORLD_TEMPLATE) as f:
        prompt = comfy_harness.api_prompt(json.load(f), info)
    for node in prompt.values():
        if node["class_type"] == "FastARWorldSampler":
            node["inputs"]["seed"] = seed
        elif node["class_type"] == "FastARActionSchedule" and smoke:
            node["inputs"]["actions"] = "A+S*3, D*2"
    return prompt


def template_runs(comfyui: str, setting: str, kind: str, repeats: int, smoke: bool, first_seed: int) -> list[dict]:
    """The world template queued ``repeats`` times to a server started for this setting."""
    import common

    common.fastar  # noqa: B018  (this checkout as comfyui_fastar, whose harness runs the server)
    from comfyui_fastar.testing import comfy_harness

    env, _ = SETTINGS[setting]
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment(env), COMFYUI_PATH=comfyui)
    runs = []
    try:
        with tempfile.TemporaryDirectory() as base, comfy_harness.comfy_server(Path(base), Path(ROOT)) as server, \
                load(kind):
            info = comfy_harness.get_json(server["url"] + "/object_info")
            for i in range(repeats):
                before = loadavg()
                tic = time.perf_counter()
                _, events = asyncio.run(comfy_harness.run_prompt(
                    server["url"], server["port"], template_prompt(info, first_seed + i, smoke), timeout=1800))
                assert not [e for e in events if e["type"] == "execution_error"], events
                runs.append({"seconds": round(time.perf_counter() - tic, 2), "loadavg": before})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return runs


def summary(runs: list[dict]) -> dict:
    out = {"median_s": statistics.median(r["seconds"] for r in runs), "runs": runs}
    if "chunk_ms" in runs[0]:
        ms = statistics.median(r["chunk_ms"] for r in runs)
        out.update(chunk_ms=ms, world_play_fps=round(12 / (ms / 1e3), 1))
    return out


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    settings, kinds = args.settings.split(","), args.loads.split(",")
    repeats = 1 if args.smoke else args.repeats
    result = {**header(torch.device("cpu")), "threads_default": torch.get_num_threads(), "settings": settings,
              "loads": kinds, "repeats": repeats, "smoke": args.smoke, "fastar": {}, "template": {}}
    for kind in kinds:
        runs = {s: [] for s in settings}
        with load(kind):
            for _ in range(repeats):  # the settings take turns: a change of load spreads over all of them
                for s in settings:
                    runs[s].append(fastar_run(s, args.smoke))
                    print(f"fastar {kind:5s} {s:5s} {runs[s][-1]}", flush=True)
        result["fastar"][kind] = {s: summary(r) for s, r in runs.items()}
    if args.comfyui:
        for kind in kinds:
            result["template"][kind] = {}
            for n, s in enumerate(x for x in settings if x != "set1"):
                runs = template_runs(args.comfyui, s, kind, repeats, args.smoke, first_seed=1 + 100 * n)
                print(f"template {kind:5s} {s:5s} {runs}", flush=True)
                result["template"][kind][s] = summary(runs)
    print(json.dumps({k: {kind: {s: v["median_s"] for s, v in by.items()} for kind, by in result[k].items()}
                      for k in ("fastar", "template")}))
    write_json(args.out, "cpu_figures_smoke.json" if args.smoke else "cpu_figures.json", result)
    return result


if __name__ == "__main__":
    main()
