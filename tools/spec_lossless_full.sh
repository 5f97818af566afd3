#!/usr/bin/env bash
# spec_lossless_full.sh: the full lossless-greedy run of issue 4 for the closing note:
# all 80 MT-bench first turns x 256 new tokens, k = 1, 3, 5, one at a time and 8 at a
# time, with the random head and (when draft/heads/smollm2-135m-eagle3 exists, or
# SPECD_SPEC_TRAINED_HEAD names one) the trained head. Prints acceptance length and
# per-position acceptance per pass (tests/spec/test_lossless_mtbench.c).
#
# Usage: tools/spec_lossless_full.sh [BUILD_DIR]   (default: build; needs the target
#        spec_lossless_mtbench built there, tools/setup.sh's model and .venv)
# Env:   OMP_NUM_THREADS (default 2), SPECD_PROMPTS_DIR, SPECD_SPEC_TRAINED_HEAD,
#        SPECD_SPEC_RANDOM=0 (trained head only; the random head at 80 x 256 is hours of CPU),
#        SPECD_SPEC_MIN_TAU (trained-head floor at k = 3).
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$src/build}"
bin="$build/tests/spec/spec_lossless_mtbench"
[ -x "$bin" ] || { echo "build it first: cmake --build $build --target spec_lossless_mtbench" >&2; exit 2; }
export SPECD_SOURCE_DIR="$src" SPECD_SPEC_FULL=1
export SPECD_MODEL_GGUF="${SPECD_MODEL_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
export SPECD_PYTHON="${SPECD_PYTHON:-$src/.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OMP_WAIT_POLICY=passive
cd "$build/tests/spec"
exec "$bin"
