"""Pack a ComfyUI tree and the packages it imports for a GPU machine whose Python lacks them.

The GPU machines have torch, torchvision, transformers and most of what ComfyUI imports, but not the
pip-installable tree's own dependencies, and nothing can be installed there. This copies, into
``DEST`` (give a git-ignored folder and carry it):

  DEST/tree   the ComfyUI tree (its ``comfy*`` packages)
  DEST/site   the pure-Python distributions ``--venv`` holds (a venv made by .ci/comfy_envs.sh) that
              the GPU image lacks, and the wheels in ``--wheels`` unpacked (the compiled ones, for
              the GPU's Python)

    python bench/comfy_site.py --tree ../shared/comfyui/core-ar-2026 --venv .comfyui/venv-2026-02 \\
        --wheels .comfyui/wheels-cp312 --dest .comfyui/gpu
    # on the GPU: PYTHONPATH=.comfyui/gpu/site python bench/comfy_bench.py --comfyui .comfyui/gpu/tree ...

The distributions copied are those named in ``DISTRIBUTIONS`` (what the tree imports for the nodes the
benchmark runs, minus what the GPU image has). The compiled ones go in ``--wheels`` as cp312 wheels: for the
2026 trees ``can_ada`` (``comfy.model_downloader_types`` imports it), and ``av`` for the Video Stream's file.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import zipfile

DISTRIBUTIONS = [
    "comfy-aimdo",  # its aimdo.so is loaded by ctypes, not as an extension module: any Python takes it
    "aio-pika", "aiormq", "backoff", "chardet", "cattrs", "ConfigArgParse", "frozendict", "gguf", "h2", "hpack", "hyperframe",
    "importlib_metadata", "natsort", "pamqp", "platformdirs", "requests-cache", "sniffio", "torchsde", "trampoline",
    "url-normalize", "googleapis-common-protos", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "opentelemetry-instrumentation", "opentelemetry-distro",
    "opentelemetry-exporter-otlp", "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto", "opentelemetry-propagator-jaeger",
    "opentelemetry-processor-baggage", "opentelemetry-util-http", "opentelemetry-instrumentation-aiohttp-client",
    "opentelemetry-instrumentation-aiohttp-server", "opentelemetry-instrumentation-urllib3",
    "opentelemetry-instrumentation-requests", "opentelemetry-instrumentation-asyncio",
    "opentelemetry-instrumentation-aio-pika", "opentelemetry-instrumentation-threading",
]
TREE_PARTS = ("comfy", "comfy_api", "comfy_execution", "comfy_extras", "comfy_compatibility", "comfy_config",
              "comfy_api_nodes", "LICENSE")


def copy_distribution(python: str, name: str, site: str) -> int:
    """Copy one installed distribution's files (and its metadata) into ``site``; returns files copied."""
    script = ("import importlib.metadata as m, sys\n"
              "try:\n d = m.distribution(sys.argv[1])\nexcept m.PackageNotFoundError:\n sys.exit(0)\n"
              "for f in d.files or []:\n print(d.locate_file(f), f, sep='\\t')\n")
    out = subprocess.run([python, "-c", script, name], check=True, capture_output=True, text=True).stdout
    n = 0
    for line in out.splitlines():
        src, rel = line.split("\t")
        if rel.startswith("..") or "__pycache__" in rel or not os.path.isfile(src):
            continue
        dst = os.path.join(site, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        n += 1
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--wheels", required=True, help="a folder of wheels for the GPU's Python (cp312)")
    p.add_argument("--dest", required=True)
    args = p.parse_args(argv)
    if os.path.exists(args.dest):
        shutil.rmtree(args.dest)
    tree, site = os.path.join(args.dest, "tree"), os.path.join(args.dest, "site")
    for part in TREE_PARTS:
        src = os.path.join(args.tree, part)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(tree, part), ignore=shutil.ignore_patterns("__pycache__"))
        elif os.path.isfile(src):
            os.makedirs(tree, exist_ok=True)
            shutil.copy2(src, tree)
    python = os.path.join(args.venv, "bin", "python")
    copied = {name: copy_distribution(python, name, site) for name in DISTRIBUTIONS}
    for wheel in sorted(glob.glob(os.path.join(args.wheels, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    missing = [n for n, c in copied.items() if c == 0]
    print(f"{args.dest}: tree + {sum(copied.values())} files of {len(copied) - len(missing)} distributions"
          + (f" (not in the venv: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()
