#!/bin/sh
# tools/kn_emu/run_comm.sh BUILD_DIR [TEST ARGS...]: builds the cuda_ipc
# communicator (engine/comm/comm_cuda_ipc.c, kernels/kn_allreduce.cu) and its
# GPU test (tests/comm/test_comm_cuda_ipc_gpu.c) against the kn_emu CPU
# emulation and runs it: real rank processes, each running the kernel's
# blocks as fibers on the CPU, the "device" regions memfd mappings opened by
# the peers (the emulation's cudaIpcOpenMemHandle), the ctrl words plain
# host memory, the graph a recording of launches. BUILD_DIR is a configured
# specd build with specd_util built. TEST ARGS go to cmocka (e.g. none).
# What a pass shows: the protocol's logic (generations, parities, flags,
# slicing, chunking, the failure paths through real processes and the
# watchdog) and the test's own logic; not GPU behaviour (memory model,
# scheduling of blocks, speed). See README.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
shift
out=${KN_EMU_OUT:-"$build/kn_emu"}
mkdir -p "$out"
CXX=${CXX:-g++}
CC=${CC:-gcc}
inc="-I$here/include -I$root"
. "$here/comm_objs.sh" # kn_allreduce.o, kn_emu_runtime.o, $objs
$CC -std=gnu17 -O2 -g -Wall -Werror -ffp-contract=off $inc -I"$root/tests" -c "$root/tests/comm/test_comm_cuda_ipc_gpu.c" \
    -o "$out/test_comm_cuda_ipc_gpu.o"
# shellcheck disable=SC2086
$CXX -o "$out/comm_cuda_ipc_gpu" "$out/test_comm_cuda_ipc_gpu.o" $objs "$out/kn_allreduce.o" "$out/kn_emu_runtime.o" \
    "$build/engine/libspecd_util.a" -lcmocka -lcrypto -lpthread -lm
echo "== comm_cuda_ipc_gpu (kn_emu)"
exec "$out/comm_cuda_ipc_gpu" "$@"
