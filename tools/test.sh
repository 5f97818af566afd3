#!/usr/bin/env bash
# tools/test.sh: configure (warnings as errors), build, run every test.
# Usage: tools/test.sh [extra ctest args]   (BUILD_DIR=build-ci by default)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD_DIR:-build-ci}
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPECD_WERROR=ON ${CMAKE_ARGS:-} >/dev/null
cmake --build "$B" -j "$(nproc)"
ctest --test-dir "$B" --output-on-failure -j "$(nproc)" "$@"
