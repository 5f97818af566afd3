#!/bin/sh
# tools/kn_emu/run.sh BUILD_DIR [TEST...]: builds specd's CUDA kernels and
# their GPU tests against the kn_emu CPU emulation and runs them (default:
# kn_attn kn_sample). BUILD_DIR is a configured specd build whose
# specd_backend / specd_runtime libraries are built (the CPU references).
# KN_EMU_OUT=DIR puts the objects and binaries there (default BUILD_DIR/kn_emu).
# An emulated pass is evidence about the kernels' logic, indexing, barriers
# and the tests themselves; it says nothing about real GPU behaviour (memory
# model, timing, expf rounding, performance). See README.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
shift
tests=${*:-"kn_attn kn_sample"}
out=${KN_EMU_OUT:-"$build/kn_emu"}
mkdir -p "$out"
CXX=${CXX:-g++}
CC=${CC:-gcc}
inc="-I$here/include -I$root"
for cu in "$root"/kernels/kn_*.cu; do
    name=$(basename "$cu" .cu)
    [ "$name" = kn_runtime ] && continue  # the probe: replaced by the emulation's
    [ "$name" = kn_blaslt ] && continue   # cuBLASLt (the real headers clash with the fake runtime): not emulated
    python3 "$here/kn_emu.py" "$cu" "$out/$name.cpp"
    $CXX -std=c++17 -O2 -g -Wall -Wno-unused-function -Wno-unknown-pragmas -Wno-unused-variable $inc -c "$out/$name.cpp" -o "$out/$name.o"
done
$CXX -std=c++17 -O2 -g -Wall $inc -c "$here/kn_emu_runtime.cpp" -o "$out/kn_emu_runtime.o"
libs="$build/engine/libspecd_runtime.a $build/engine/libspecd_model.a $build/engine/libspecd_tokenizer.a \
$build/engine/libspecd_loader.a $build/engine/libspecd_backend.a $build/engine/libspecd_util.a"
rc=0
for t in $tests; do
    $CC -std=gnu17 -O2 -g -ffp-contract=off $inc -c "$root/tests/kernels/test_$t.c" -o "$out/test_$t.o"
    $CXX -o "$out/$t" "$out/test_$t.o" "$out"/kn_*.o $libs -ljansson -lpcre2-8 -lcrypto -lgomp -lm -lpthread
    echo "== $t (kn_emu)"
    "$out/$t" || rc=$?
done
exit $rc
