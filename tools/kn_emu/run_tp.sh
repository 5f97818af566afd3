#!/bin/sh
# tools/kn_emu/run_tp.sh BUILD_DIR: tensor parallelism with every rank on the
# fake CUDA device (tests/backend/cuda_fake.c) and the collectives through
# the REAL cuda_ipc communicator (engine/comm/comm_cuda_ipc.c and
# kernels/kn_allreduce.cu, the kernel in the kn_emu CPU emulation, the peers'
# regions memfd mappings): tests/backend/test_cuda_tp.c with
# SPECD_TP_TEST_COMM=cuda_ipc, i.e. `--tp-comm cuda_ipc`'s adapter in
# engine/runtime/tp.c (in-place all-reduce, the all-gather's rank-major
# layout, the sync after each forward) on real rank processes. Logits must
# equal CPU TP's bit for bit (cuda_ipc sums in rank order in f32, like shm).
# Then tests/backend/test_cuda_tp_sample.c the same way: sampling on the
# device at TP 2, with the device -> host bytes of every step checked (no
# host staging under cuda_ipc). Then tests/backend/test_cuda_tp_draft.c: the
# EAGLE-3 head split across the device ranks (SmolLM2 at TP 3 with a
# vocabulary-split draft LM head), rank 0's bytes per step exactly the table.
# Then tests/backend/test_cuda_tp_graphs.c: CUDA graphs at TP 2, the emulated
# cuda_ipc kernels recorded into the fake's graphs (cuda_fake.c
# fake_capture_foreign) and replayed STEPS times: == eager == CPU TP bitwise.
# The fake's CUDA names are renamed fake_*, so it links next to the
# emulation's cudart. BUILD_DIR: a configured specd build with the engine's
# and draft's static libraries built. Runs the HF minis (MODEL_HF_MINI_DIR,
# default BUILD_DIR/model_hf_mini), not SmolLM2 (slow under emulation); SmolLM2 only for the
# draft test (test_cuda_tp_draft.c, its quick mode: one case).
# run_tp.sh BUILD_DIR kimi: tests/backend/test_cuda_kimi_tp.c instead (the
# 8-head Kimi miniature at TP 2 and expert parallel 2, KIMI_TP_QUICK=1; KIMI_C_MINI_DIR, default
# BUILD_DIR/kimi_c_mini): DeepSeek-V3's collectives through cuda_ipc, every
# logit / hidden / aux value == CPU TP's bits, == the staged shm run's and a
# rerun's (the GPU build's checks, KIMI_TP_GPU_LOGIC=1).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
out=${KN_EMU_OUT:-"$build/kn_emu_tp"}
mkdir -p "$out"
CXX=${CXX:-g++}
CC=${CC:-gcc}
inc="-I$here/include -I$root"
. "$here/comm_objs.sh" # kn_allreduce.o, kn_emu_runtime.o, $objs
# the test and the fake device: the project's own include path (the fake's header comes first by name)
tinc="-I$root -I$root/tests -I$root/tests/backend/cuda_fake"
tests="test_cuda_tp test_cuda_tp_sample test_cuda_tp_graphs test_cuda_tp_draft"
[ "${2:-}" = kimi ] && tests=test_cuda_kimi_tp
[ "${2:-}" = graphs ] && tests=test_cuda_tp_graphs # run_tp.sh BUILD_DIR graphs: only the graphs test
for t in $tests; do # (test_cuda_kimi_tp.c is also built for a real GPU: the fake's header comes by -include)
    $CC -std=gnu17 -O2 -g -Wall -Werror -ffp-contract=off $tinc -include "$root/tests/backend/cuda_fake/cuda_runtime_api.h" \
        -c "$root/tests/backend/$t.c" -o "$out/$t.o"
done
$CC -std=gnu17 -O2 -g -Wall -Werror -ffp-contract=off $tinc -c "$root/tests/backend/cuda_fake.c" -o "$out/cuda_fake.o"
# the TP adapter compiled from the source here (not taken from BUILD_DIR's library, which may be older)
$CC -std=gnu17 -O2 -g -Wall -Werror -ffp-contract=off -I"$root" -c "$root/engine/runtime/tp.c" -o "$out/tp.o"
lib="$build/engine"
libs="$build/draft/libspecd_draft.a $lib/libspecd_runtime.a $lib/libspecd_model.a $lib/libspecd_tokenizer.a
      $lib/libspecd_loader.a $lib/libspecd_backend.a $build/kernels/libspecd_kn_pack.a $lib/libspecd_util.a"
for t in $tests; do
    # shellcheck disable=SC2086
    $CXX -o "$out/$t" "$out/$t.o" "$out/cuda_fake.o" "$out/tp.o" $objs "$out/kn_allreduce.o" "$out/kn_emu_runtime.o" \
        $libs -ljansson -lpcre2-8 -lcrypto -lpthread -lm
done
if [ "${2:-}" = kimi ]; then
    # KIMI_TP_GPU_LOGIC=1: also the GPU build's checks (cuda_ipc == shm staged and a rerun, bit for bit)
    export KIMI_C_MINI_DIR=${KIMI_C_MINI_DIR:-"$build/kimi_c_mini"} KIMI_TP_QUICK=1 SPECD_TP_TEST_COMM=cuda_ipc \
        KIMI_TP_GPU_LOGIC=1
    echo "== backend_cuda_kimi_tp with --tp-comm cuda_ipc (kn_emu): the 8-head Kimi miniature at TP 2"
    exec "$out/test_cuda_kimi_tp"
fi
export MODEL_HF_MINI_DIR=${MODEL_HF_MINI_DIR:-"$build/model_hf_mini"} SPECD_MODEL_GGUF= SPECD_TP_TEST_COMM=cuda_ipc
if [ "${2:-}" = graphs ]; then
    echo "== backend_cuda_tp_graphs with --tp-comm cuda_ipc (kn_emu): CUDA graphs at TP 2, the cuda_ipc kernels captured"
    exec "$out/test_cuda_tp_graphs"
fi
echo "== backend_cuda_tp with --tp-comm cuda_ipc (kn_emu)"
"$out/test_cuda_tp"
echo "== backend_cuda_tp_sample with --tp-comm cuda_ipc (kn_emu): device sampling at TP 2, bytes per step checked"
"$out/test_cuda_tp_sample"
echo "== backend_cuda_tp_graphs with --tp-comm cuda_ipc (kn_emu): CUDA graphs at TP 2, the cuda_ipc kernels captured"
"$out/test_cuda_tp_graphs"
# the EAGLE-3 head split across the device ranks (SmolLM2 at TP 3, its LM head split by vocabulary: the
# all-gather through cuda_ipc), rank 0's bytes per step exactly the table; needs the SmolLM2 GGUF
gguf="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -r "$gguf" ]; then
    echo "== backend_cuda_tp_draft with --tp-comm cuda_ipc (kn_emu): the split head at TP 3, bytes per step exact"
    SPECD_MODEL_GGUF="$gguf" SPECD_SOURCE_DIR="$root" SPECD_TP_DRAFT_QUICK=1 exec "$out/test_cuda_tp_draft"
fi
echo "== backend_cuda_tp_draft: skipped ($gguf not readable)"
