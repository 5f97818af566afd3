#!/usr/bin/env bash
# tools/ci_fuzz.sh: the fuzzing stage of CI (issue 10): every libFuzzer harness
# (tools/fuzz.sh) for FUZZ_SECONDS (default 60) each, one after the other.
# A finding fails the stage and prints the input and the reproduction command;
# keep the input under tests/fuzz/regressions/<harness>/ once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec tools/fuzz.sh "${FUZZ_SECONDS:-60}"
