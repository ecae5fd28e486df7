#!/usr/bin/env bash
# The ComfyUI tests against the three real ComfyUI trees in ../shared/comfyui (v0.3.64, 2026-02,
# core-ar-2026), each in its own environment (.ci/comfy_envs.sh). Fails if any test fails or skips:
# every test collected here is meant to run against its tree. The cache widget's browser test needs
# Chromium and Playwright and is deselected here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENVS=${COMFY_ENVS:-$ROOT/.comfyui}
TESTS=("$ROOT/tests/test_comfy_bridge.py" "$ROOT/tests/test_comfy_server.py" "$ROOT/tests/test_comfy_pack.py"
       "$ROOT/tests/test_comfy_video.py" "$ROOT/tests/test_comfy_checkpoints.py")
# test_fp8_linear.py's ComfyUI tests only (its others are the everyday run's and the GPU's)
for t in test_comfy_fp8_weights_run_as_fp8_linears_over_their_own_tensors \
         test_comfy_fp8_linears_opt_in_for_weights_in_a_compute_dtype \
         test_comfy_patch_model_fp8_linears_reach_the_fused_engine; do
  TESTS+=("$ROOT/tests/test_fp8_linear.py::$t")
done
status=0
while read -r name tree python; do
  files=("${TESTS[@]}")
  [[ -f "$tree/comfy/ldm/wan/ar_model.py" ]] && files+=("$ROOT/tests/test_comfy_core_ar.py")
  work=$(mktemp -d)  # the pip-installable trees create input/, output/ ... in the working directory
  echo "== ComfyUI $name ($tree)"
  if ! (cd "$work" && COMFYUI_PATH="$tree" COMFYUI_CPU=true PYTHONDONTWRITEBYTECODE=1 \
        "$python" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
        -k "not frontend" "${files[@]}" -rs | tee "$work/log"); then
    status=1
  fi
  if grep -qE "^SKIPPED|[0-9]+ skipped" "$work/log"; then
    echo "comfy_tests: tests were skipped against ComfyUI $name" >&2
    status=1
  fi
  rm -rf "$work"
done < <("$ROOT/.ci/comfy_envs.sh" "$ENVS")
exit $status
