#!/usr/bin/env bash
# spec_lossless_full.sh: the full lossless-greedy run of issue 4 for the closing note:
# all 80 MT-bench first turns x 256 new tokens, k = 1, 3, 5, one at a time and 8 at a
# time, with the random head and (when draft/heads/smollm2-135m-eagle3 exists, or
# SPECD_SPEC_TRAINED_HEAD names one) the trained head (tests/spec/test_lossless_mtbench.c).
#
# The prompts are split over SHARDS processes (SPECD_SPEC_SHARD=i/n: prompt r goes to
# shard r % n), each with one compute thread, run side by side: at batch 1 this small
# model gains less from a second thread than from a second process. Every shard checks
# every one of its outputs token for token against its own plain-greedy reference; the
# script then sums the shards' spec-decode counts per (head, k, mode) and prints the
# acceptance length and per-position acceptance of the whole set, and checks the
# trained head's floor at k = 3 on the sums.
#
# Usage: tools/spec_lossless_full.sh [BUILD_DIR]   (default: build; needs the target
#        spec_lossless_mtbench built there, tools/setup.sh's model and .venv)
# Env:   SHARDS (default nproc), SPECD_PROMPTS_DIR, SPECD_SPEC_TRAINED_HEAD,
#        SPECD_SPEC_RANDOM=0 (trained head only; the random head at 80 x 256 is hours of CPU),
#        SPECD_SPEC_MIN_TAU (trained-head floor at k = 3; default the test's own),
#        SPECD_SPEC_PROMPTS / SPECD_SPEC_NEW (smaller runs), LOG_DIR (default BUILD/spec-full),
#        AGGREGATE_ONLY=1 (run nothing: re-check and sum the shard logs already in LOG_DIR).
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$src/build}" && pwd)"
bin="$build/tests/spec/spec_lossless_mtbench"
[ -x "$bin" ] || { echo "build it first: cmake --build $build --target spec_lossless_mtbench" >&2; exit 2; }
export SPECD_SOURCE_DIR="$src" SPECD_SPEC_FULL=1
export SPECD_MODEL_GGUF="${SPECD_MODEL_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
export SPECD_PYTHON="${SPECD_PYTHON:-$src/.venv/bin/python}"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
shards="${SHARDS:-$(nproc)}"
logs="${LOG_DIR:-$build/spec-full}"
mkdir -p "$logs"
floor="${SPECD_SPEC_MIN_TAU:-$(sed -n 's/^#define TRAINED_HEAD_MIN_TAU_K3 //p' "$src/tests/spec/test_lossless_mtbench.c")}"
[[ "$floor" =~ ^[0-9.]+$ ]] || { echo "spec_lossless_full: cannot read the floor (TRAINED_HEAD_MIN_TAU_K3): '$floor'" >&2; exit 2; }
rc=0
if [ "${AGGREGATE_ONLY:-0}" = 1 ]; then  # re-read the logs of an earlier run in LOG_DIR
  echo "spec_lossless_full: summing the $shards shard logs in $logs"
  for ((i = 0; i < shards; i++)); do
    if grep -q '^\[  PASSED  \]' "$logs/shard$i.log"; then echo "shard $i/$shards: passed"
    else rc=1; echo "shard $i/$shards: FAILED or unfinished, see $logs/shard$i.log"; fi
  done
else
  echo "spec_lossless_full: $shards shards, logs in $logs, started $(date -u +%FT%TZ)"
  pids=()
  for ((i = 0; i < shards; i++)); do
    (cd "$build/tests/spec" && SPECD_SPEC_SHARD="$i/$shards" SPECD_SPEC_MIN_TAU=0 exec "$bin") >"$logs/shard$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then echo "shard $i/$shards: passed"; else rc=1; echo "shard $i/$shards: FAILED, see $logs/shard$i.log"; fi
  done
fi
grep -h '^reference:' "$logs"/shard*.log || true
python3 - "$floor" "$shards" "$logs"/shard*.log <<'PY' || rc=1
import re, sys
floor, shards, logs = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
pat = re.compile(r"^(\S+)\s+k=(\d+) (\S+)\s*: (\d+) tokens, .*?([\d.]+) s CPU; counts: drafts (\d+) draft_tokens (\d+) "
                 r"accepted (\d+) per_pos((?: \d+)*)$")
agg = {}
for f in logs:
    for line in open(f):
        m = pat.match(line.strip())
        if not m:
            continue
        head, k, mode = m.group(1), int(m.group(2)), m.group(3)
        a = agg.setdefault((head, k, mode), {"tokens": 0, "cpu": 0.0, "drafts": 0, "dt": 0, "acc": 0, "pp": [0] * k, "n": 0})
        a["tokens"] += int(m.group(4)); a["cpu"] += float(m.group(5)); a["drafts"] += int(m.group(6))
        a["dt"] += int(m.group(7)); a["acc"] += int(m.group(8)); a["n"] += 1
        for i, c in enumerate(m.group(9).split()):
            a["pp"][i] += int(c)
ok = True
print("head     k  mode        shards  tokens  drafts  acceptance length  rate    per position            CPU s")
for (head, k, mode), a in sorted(agg.items()):
    tau = 1 + a["acc"] / a["drafts"]
    pp = " ".join("%.3f" % (c / a["drafts"]) for c in a["pp"])
    print("%-8s %d  %-10s  %6d  %6d  %6d  %17.3f  %.3f   %-22s  %.0f" % (head, k, mode, a["n"], a["tokens"], a["drafts"],
          tau, a["acc"] / a["dt"] if a["dt"] else 0, pp, a["cpu"]))
    if a["n"] != shards:
        print("%s k=%d %s: only %d of %d shards reported; the sums above are partial" % (head, k, mode, a["n"], shards))
        ok = False
    if head == "trained" and k == 3 and mode == "concurrent" and floor > 0 and tau < floor:
        print("trained head: acceptance length %.3f at k=3 is below the floor %.3f" % (tau, floor)); ok = False
if not agg:
    print("no results parsed"); ok = False
sys.exit(0 if ok else 1)
PY
echo "spec_lossless_full: $([ $rc = 0 ] && echo PASSED: every output token-identical to plain greedy || echo FAILED) ($(date -u +%FT%TZ))"
exit $rc
