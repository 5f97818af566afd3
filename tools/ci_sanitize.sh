#!/usr/bin/env bash
# tools/ci_sanitize.sh: the ASan + UBSan stage of CI (issue 10).
#   1. builds everything with -DSPECD_SANITIZE=ON (gcc, -fsanitize=address,undefined,
#      -fno-sanitize-recover=undefined) into build-asan;
#   2. runs every test labelled "unit" (C unit tests, fuzz replays, the Kimi C tests)
#      with LeakSanitizer on, except the pure-Python ones (nothing to sanitize:
#      kimi_numpy_forward, kimi_mini_generator, deploy tests);
#   3. runs the end-to-end server tests and the reliability fault/hostile tests
#      against the sanitized `specd` with ASAN_OPTIONS=detect_leaks=1: a leak,
#      overflow or UB report makes the server exit non-zero, which they assert.
# Usage: tools/ci_sanitize.sh [extra ctest args]    (ASAN_BUILD_DIR=build-asan)
# Measured (issue 10, loaded 2-core machine): build 175 s CPU, unit tests 171 s CPU,
# e2e + reliability ~see docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${ASAN_BUILD_DIR:-build-asan}
J=$(nproc)
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPECD_WERROR=ON -DSPECD_SANITIZE=ON ${CMAKE_ARGS:-} >/dev/null
cmake --build "$B" -j "$J"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
PY_ONLY='^(kimi_numpy_forward|kimi_mini_generator|kimi_int4_fixture|kimi_pcre2_pattern|kimi_budget_doc|deploy_.*)$'
ctest --test-dir "$B" --output-on-failure -j "$J" -L unit -E "$PY_ONLY" "$@"
# The real server under ASan/LSan: fault, hostile-client and overload tests always; the
# 44-case server_e2e (about 10 minutes sanitized on 2 cores) with SPECD_ASAN_E2E=1,
# to keep CI inside its 60-minute budget.
E2E='^(reliability_faults|reliability_hostile|reliability_overload)$'
[[ "${SPECD_ASAN_E2E:-0}" == 1 ]] && E2E='^(server_e2e|reliability_faults|reliability_hostile|reliability_overload)$'
ctest --test-dir "$B" --output-on-failure -j "$J" -R "$E2E" "$@"
echo "ci_sanitize: ok"
