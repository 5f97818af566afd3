#!/bin/bash
# isa_check.sh BUILD_DIR [OUT_DIR]: the CPU kernel levels on this machine.
#
# 1. backend_matmul: every weight format against its scalar reference, on each
#    level the CPU has (portable, AVX2, AVX-512; AVX-512 == AVX2 bit for bit).
# 2. model_batch_invariance on a SmolLM2-135M shape twin (tools/make_twin_gguf.py,
#    random weights, the real file's shapes and formats) or on $SPECD_MODEL_GGUF:
#    batch invariance at the best level, and AVX-512 logits == AVX2 logits.
# 3. kimi_c_int4 / kimi_c_logits / kimi_c_batch_invariance on the Kimi miniature
#    (I4G32 and BF16 kernels against the compressed-tensors / transformers
#    fixtures) at the best level, if the miniature can be generated (numpy).
# 4. perf_model decode / prefill / verify throughput for each level and thread count.
# Meant for machines with AVX-512 (where CI, without it, skips those cases).
# Needs python3 with numpy. Prints a summary; exits non-zero if a check failed.
set -u
B=$(cd "${1:?usage: isa_check.sh BUILD_DIR [OUT_DIR]}" && pwd)
OUT=${2:-/tmp/isa_check}
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${SPECD_PYTHON:-python3}
mkdir -p "$OUT"
export SPECD_SOURCE_DIR=$SRC
fail=0
run() { # name cmd...
    local name=$1; shift
    if "$@" >"$OUT/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (rc $?, $OUT/$name.log)"; fail=1; tail -20 "$OUT/$name.log"; fi
}
grep -m1 "model name" /proc/cpuinfo
grep -m1 -o -w -E "avx512f|avx512bw|avx512vl|avx512dq" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run backend_matmul "$B/tests/backend/backend_matmul"
grep -E "^\[ *(PASSED|FAILED|SKIPPED) *\] [0-9]+ test" "$OUT/backend_matmul.log"

MODEL=${SPECD_MODEL_GGUF:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    MODEL=$OUT/twin.gguf
    [ -f "$MODEL" ] || "$PY" "$SRC/tools/make_twin_gguf.py" "$MODEL" || fail=1
fi
echo "model: $MODEL"
SPECD_MODEL_GGUF=$MODEL run model_batch_invariance "$B/tests/model/model_batch_invariance"
grep -E "^backend:|^\[ *(PASSED|FAILED|SKIPPED) *\] [0-9]+ test" "$OUT/model_batch_invariance.log"

MINI=$OUT/kimi_mini
if "$PY" "$SRC/tests/kimi_c/make_minis.py" "$MINI" >"$OUT/kimi_mini.log" 2>&1; then
    for t in int4 logits batch_invariance; do
        KIMI_C_MINI_DIR=$MINI run kimi_c_$t "$B/tests/kimi_c/kimi_c_$t"
    done
else
    echo "SKIP kimi_c_*: the miniature could not be generated ($OUT/kimi_mini.log)"
fi

echo "perf_model (prompt 128, decode 64): level threads -> prefill tok/s, decode tok/s, verify k=3 cost"
SPECD_CPU_ISA=avx512 "$B/tests/perf/perf_model" "$MODEL" 1 4 1 2>/dev/null | grep -m1 backend:
for isa in avx2 avx512; do
    for t in ${THREADS:-1 2 4 8}; do
        SPECD_CPU_ISA=$isa "$B/tests/perf/perf_model" "$MODEL" "$t" 128 64 >"$OUT/perf_${isa}_$t.log" 2>&1 || fail=1
        ran=$(grep -o -m1 -E "avx512|avx2|portable" "$OUT/perf_${isa}_$t.log")
        printf '%-6s %2d  %s | %s | %s\n' "$ran" "$t" \
            "$(grep -o 'prefill.*tok/s wall' "$OUT/perf_${isa}_$t.log")" \
            "$(grep -o 'decode.*tok/s wall' "$OUT/perf_${isa}_$t.log")" \
            "$(grep -o 'k=3.*decode step' "$OUT/perf_${isa}_$t.log")"
    done
done
[ $fail = 0 ] && echo "isa_check: all checks passed" || echo "isa_check: FAILED"
exit $fail
