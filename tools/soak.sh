#!/usr/bin/env bash
# tools/soak.sh: the long soak/load run of issue 10 (tests/reliability/soak.py).
#   64 concurrent streaming clients on SmolLM2 with a random EAGLE-3 head
#   (speculation on, prefix caching on) for 30 minutes: random disconnects,
#   random stop strings, n > 1, a burst over --max-waiting half-way; at the end
#   KV and draft KV blocks all free, /health 200, RSS flat after warm-up.
# Usage: tools/soak.sh [DURATION_S] [CLIENTS] [extra soak.py args, e.g. --threads 2 --draft DIR]
#   BUILD_DIR (default build-ci) must hold a built `specd`; the report is
#   written to $BUILD_DIR/soak-report.json (SOAK_REPORT to change).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-1800}
CLIENTS=${2:-64}
shift 2 || shift $# || true
B=${BUILD_DIR:-build-ci}
if [[ ! -x "$B/server/specd" ]]; then
  cmake -S . -B "$B" -DSPECD_WERROR=ON >/dev/null
  cmake --build "$B" -j "$(nproc)" --target specd
fi
export SPECD_BUILD_DIR=$PWD/$B SPECD_SOURCE_DIR=$PWD SPECD_PYTHON=$PWD/.venv/bin/python
export SPECD_MODEL_GGUF=${SPECD_MODEL_GGUF:-$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf}
exec .venv/bin/python tests/reliability/soak.py --duration "$DUR" --clients "$CLIENTS" \
  --max-num-seqs 64 --max-waiting 48 --kv-cache-memory 64M --report "${SOAK_REPORT:-$B/soak-report.json}" "$@"
