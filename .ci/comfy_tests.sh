#!/usr/bin/env bash
# The ComfyUI tests against the three real ComfyUI trees in ../shared/comfyui (v0.3.64, 2026-02,
# core-ar-2026), each in its own environment (.ci/comfy_envs.sh): every test marked comfyui
# (pyproject.toml), wherever it lives under tests/. Those also marked core_ar need core's autoregressive
# path and are deselected on a tree without comfy/ldm/wan/ar_model.py; this fails unless some tree ran
# them. Likewise those marked taehv (core's TAEHV fast decoders, comfy/taesd/taehv.py). Fails if any
# test fails or skips: every test selected here is meant to run against its tree.
# The cache widget's browser tests need Chromium and Playwright and are deselected here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENVS=${COMFY_ENVS:-$ROOT/.comfyui}
status=0
core_ar_trees=0
taehv_trees=0
while read -r name tree python; do
  marks="comfyui"
  if [[ -f "$tree/comfy/ldm/wan/ar_model.py" ]]; then
    core_ar_trees=$((core_ar_trees + 1))
  else
    marks="$marks and not core_ar"
  fi
  if [[ -f "$tree/comfy/taesd/taehv.py" ]]; then
    taehv_trees=$((taehv_trees + 1))
  else
    marks="$marks and not taehv"
  fi
  work=$(mktemp -d)  # the pip-installable trees create input/, output/ ... in the working directory
  echo "== ComfyUI $name ($tree): -m \"$marks\""
  if ! (cd "$work" && COMFYUI_PATH="$tree" COMFYUI_CPU=true PYTHONDONTWRITEBYTECODE=1 \
        "$python" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
        -m "$marks" -k "not frontend" "$ROOT/tests" -rs --durations=10 | tee "$work/log"); then
    status=1
  fi
  if grep -qE "^SKIPPED|[0-9]+ skipped" "$work/log"; then
    echo "comfy_tests: tests were skipped against ComfyUI $name" >&2
    status=1
  fi
  rm -rf "$work"
done < <("$ROOT/.ci/comfy_envs.sh" "$ENVS")
if (( core_ar_trees == 0 )); then
  echo "comfy_tests: no tree has comfy/ldm/wan/ar_model.py: the core_ar tests ran nowhere" >&2
  status=1
fi
if (( taehv_trees == 0 )); then
  echo "comfy_tests: no tree has comfy/taesd/taehv.py: the taehv tests ran nowhere" >&2
  status=1
fi
exit $status
