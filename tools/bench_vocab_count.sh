#!/usr/bin/env bash
# tools/bench_vocab_count.sh: the `specd vocab count` benchmark (issue 5: the
# tokenizer must not be the bottleneck). Counts GSM8K train (7,473
# conversations, 1.62 M rendered tokens) with 1 and 2 threads, REPEATS times
# each, and prints count's own speed lines: wall and CPU-time tokens/s, and the
# time spent reading + JSON-parsing the file before counting.
# Usage: tools/bench_vocab_count.sh [DATA.jsonl] [REPEATS]   (BUILD_DIR=build-ci by default)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data/prompts/gsm8k_train.jsonl}
REPEATS=${2:-3}
B=${BUILD_DIR:-build-ci}
M=${SPECD_MODEL_GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[[ -x "$B/server/specd" ]] || { echo "bench_vocab_count: build $B first (tools/test.sh)" >&2; exit 1; }
[[ -f "$DATA" ]] || { echo "bench_vocab_count: $DATA not found" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for t in 1 2; do
  for ((i = 1; i <= REPEATS; i++)); do
    echo "threads $t, run $i:"
    "$B/server/specd" vocab count --target "$M" --data "$DATA" --threads "$t" --output "$out/f.npy" 2>&1 |
      grep -E "^(tokens|speed|reading)" | sed 's/^/  /'
  done
done
