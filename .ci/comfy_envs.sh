#!/usr/bin/env bash
# Usage: .ci/comfy_envs.sh DIR
#
# Python environments that run the pack's tests inside the three real ComfyUI trees in
# ../shared/comfyui (v0.3.64, 2026-02, core-ar-2026). One torch install (torch 2.14.1 +
# torchvision 0.29.1: the trees import torchvision at module level, and none imports beside the
# CPU-only 2.13.0 wheel) is shared through a .pth file; each venv adds its tree's own
# requirements as of the tree's date (pip --uploaded-prior-to), as ../shared/tools/comfy_host.sh
# does. The two February 2026 trees share their requirements, so they share one venv.
# Prints "NAME TREE PYTHON" per tree on stdout.
set -euo pipefail
DIR=$(mkdir -p "${1:?usage: comfy_envs.sh DIR}" && cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
TREES=$(cd "$HERE/../shared/comfyui" && pwd)
say() { echo "comfy_envs: $*" >&2; }

if [[ ! -f "$DIR/torch/.done" ]]; then
  say "torch 2.14.1 + torchvision 0.29.1 into $DIR/torch"
  python3 -m pip install -q --target "$DIR/torch" torch==2.14.1 torchvision==0.29.1 >&2
  touch "$DIR/torch/.done"
fi

venv() {  # venv NAME TREE CUTOFF
  local name=$1 tree=$2 cut=$3 v="$DIR/venv-$1"
  if [[ ! -f "$v/.done" ]]; then
    say "venv $name for $tree (packages as of $cut)"
    python3 -m venv "$v"
    local site; site=$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$DIR/torch" > "$site/shared_torch.pth"
    "$v/bin/python" -m pip install -q -U pip >&2
    "$v/bin/python" - "$tree" > "$v/requirements.txt" <<'PY'
import os, re, sys, tomllib
tree = sys.argv[1]
req = os.path.join(tree, "requirements.txt")
lines = open(req).read().splitlines() if os.path.exists(req) else \
    tomllib.load(open(os.path.join(tree, "pyproject.toml"), "rb"))["project"]["dependencies"]
for line in lines:
    line = line.split("#")[0].strip()
    if line and not re.match(r"(torch|torchvision|torchaudio)\s*([<>=!~;\[]|$)", line, re.I):
        print(line)
print("pytest>=7")
print("matplotlib>=3.6")  # the pack's own dependency (it is installed with --no-deps below)
PY
    printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$v/constraints.txt"
    "$v/bin/python" -m pip install -q --isolated --uploaded-prior-to "$cut" -c "$v/constraints.txt" \
        -r "$v/requirements.txt" >&2
    "$v/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$HERE" >&2
    touch "$v/.done"
  fi
  echo "$v/bin/python"
}

py=$(venv v0.3.64 "$TREES/v0.3.64" 2025-10-09T00:00:00Z)
echo "v0.3.64 $TREES/v0.3.64 $py"
py=$(venv 2026-02 "$TREES/2026-02" 2026-02-11T00:00:00Z)
echo "2026-02 $TREES/2026-02 $py"
echo "core-ar-2026 $TREES/core-ar-2026 $py"
