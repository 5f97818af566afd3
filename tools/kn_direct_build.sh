#!/usr/bin/env bash
# kn_direct_build.sh OUT_DIR [JOBS]: builds the kernel tests and kn_bench
# with nvcc and cc alone, no CMake and none of the server's libraries
# (libmicrohttpd, jansson, pcre2, curl, cmocka, OpenSSL): tools/gpu_check.sh's
# fallback for a GPU machine whose configure fails for want of them. Same
# code and flags as the CMake build (sm_90a SASS + compute_90 PTX, warnings
# as errors, cudart static); writes OUT_DIR/{kn_probe,kn_linear,kn_bench,kn_moe,kn_moe_bench}.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: kn_direct_build.sh OUT_DIR [JOBS]}
JOBS=${2:-$(nproc)}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUDA_INC=$(dirname "$(dirname "$NVCC")")/include
mkdir -p "$OUT/obj"
CFLAGS="-O2 -std=gnu17 -ffp-contract=off -fno-math-errno -Wall -Wextra -Wno-unused-parameter -Werror -I$ROOT -I$CUDA_INC"
NVFLAGS="-O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90 -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Wno-unused-parameter,-Werror -I$ROOT"
jobs_wait() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; }
pids=()
for f in "$ROOT"/kernels/*.cu; do
    jobs_wait
    "$NVCC" $NVFLAGS -c "$f" -o "$OUT/obj/$(basename "$f").o" & pids+=($!)
done
for f in "$ROOT"/engine/backend/*.c "$ROOT"/engine/util/*.c "$ROOT"/engine/runtime/sampler.c \
         "$ROOT"/tests/kernels/test_kn_probe.c "$ROOT"/tests/kernels/test_kn_linear.c "$ROOT"/tests/perf/kn_bench.c \
         "$ROOT"/kernels/kn_moe_pack.c "$ROOT"/engine/model/deepseek_v3_route.c "$ROOT"/tests/kernels/test_kn_moe.c \
         "$ROOT"/tests/perf/kn_moe_bench.c; do
    jobs_wait
    cc $CFLAGS -c "$f" -o "$OUT/obj/$(basename "$f").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
O=$OUT/obj
LIB="$O/*.cu.o"
ENG="$(ls "$O"/*.c.o | grep -v -e test_kn_ -e kn_bench -e kn_moe_bench | tr '\n' ' ')"
# shellcheck disable=SC2086
"$NVCC" -o "$OUT/kn_probe" "$O/test_kn_probe.c.o" $LIB -lm -lpthread -ldl
# shellcheck disable=SC2086
"$NVCC" -o "$OUT/kn_linear" "$O/test_kn_linear.c.o" $ENG $LIB -lm -lpthread -ldl
# shellcheck disable=SC2086
"$NVCC" -o "$OUT/kn_bench" "$O/kn_bench.c.o" $LIB -lm -lpthread -ldl
# shellcheck disable=SC2086
"$NVCC" -o "$OUT/kn_moe" "$O/test_kn_moe.c.o" $ENG $LIB -lm -lpthread -ldl
# shellcheck disable=SC2086
"$NVCC" -o "$OUT/kn_moe_bench" "$O/kn_moe_bench.c.o" "$O/kn_moe_pack.c.o" $LIB -lm -lpthread -ldl
echo "built $OUT/kn_probe $OUT/kn_linear $OUT/kn_bench $OUT/kn_moe $OUT/kn_moe_bench"
