#!/bin/sh
# tools/kn_emu/run.sh BUILD_DIR [TEST...]: builds specd's CUDA kernels and
# their GPU tests against the kn_emu CPU emulation and runs them (default:
# every kernel test: kn_linear kn_attn kn_sample kn_mla kn_moe). BUILD_DIR is
# a configured specd build whose specd_backend / specd_runtime / specd_model /
# specd_kn_pack libraries are built (the CPU references the tests link).
# KN_EMU_OUT=DIR puts the objects and binaries there (default BUILD_DIR/kn_emu).
# KN_EMU_BUILD_ONLY=1 builds without running. Each test's exit status is kept;
# the script exits with the first failure's (77 = skipped stays 77 only when
# every test skipped). Every kernels/kn_*.cu is built except kn_runtime (the
# probe: the emulation has its own) and kn_blaslt (cuBLASLt's headers clash
# with the fake runtime; kn_emu_blaslt.cpp answers "cuBLASLt not available").
# An emulated pass is evidence about the kernels' logic, indexing, barriers
# and the tests themselves; it says nothing about real GPU behaviour (memory
# model, timing, expf rounding, performance). See README.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
shift
tests=${*:-"kn_linear kn_attn kn_sample kn_mla kn_moe"}
out=${KN_EMU_OUT:-"$build/kn_emu"}
mkdir -p "$out"
CXX=${CXX:-g++}
CC=${CC:-gcc}
inc="-I$here/include -I$root"
cxxflags="-std=c++17 -O2 -g -Wall -Wno-unused-function -Wno-unknown-pragmas -Wno-unused-variable"
objs=""
for cu in "$root"/kernels/kn_*.cu; do
    name=$(basename "$cu" .cu)
    [ "$name" = kn_runtime ] && continue  # the probe: replaced by the emulation's
    [ "$name" = kn_blaslt ] && continue   # cuBLASLt: kn_emu_blaslt.cpp instead
    python3 "$here/kn_emu.py" "$cu" "$out/$name.cpp"
    # shellcheck disable=SC2086
    $CXX $cxxflags $inc -c "$out/$name.cpp" -o "$out/$name.o"
    objs="$objs $out/$name.o"
done
# shellcheck disable=SC2086
$CXX $cxxflags $inc -c "$here/kn_emu_runtime.cpp" -o "$out/kn_emu_runtime.o"
# shellcheck disable=SC2086
$CXX $cxxflags $inc -c "$here/kn_emu_blaslt.cpp" -o "$out/kn_emu_blaslt.o"
objs="$objs $out/kn_emu_runtime.o $out/kn_emu_blaslt.o"
libs="$build/engine/libspecd_runtime.a $build/engine/libspecd_model.a $build/engine/libspecd_tokenizer.a \
$build/engine/libspecd_loader.a $build/engine/libspecd_backend.a $build/engine/libspecd_util.a \
$build/kernels/libspecd_kn_pack.a"
for t in $tests; do
    # shellcheck disable=SC2086
    $CC -std=gnu17 -O2 -g -Wall -ffp-contract=off $inc -c "$root/tests/kernels/test_$t.c" -o "$out/test_$t.o"
    # shellcheck disable=SC2086
    $CXX -o "$out/$t" "$out/test_$t.o" $objs $libs -ljansson -lpcre2-8 -lcrypto -lgomp -lm -lpthread
done
[ "${KN_EMU_BUILD_ONLY:-0}" = 1 ] && exit 0
rc=0
skipped=0
n=0
for t in $tests; do
    n=$((n + 1))
    echo "== $t (kn_emu)"
    t0=$(date +%s)
    trc=0
    "$out/$t" || trc=$?
    echo "== $t (kn_emu): exit $trc, $(($(date +%s) - t0)) s"
    if [ "$trc" = 77 ]; then
        skipped=$((skipped + 1))
    elif [ "$trc" != 0 ] && [ "$rc" = 0 ]; then
        rc=$trc
    fi
done
[ "$rc" = 0 ] && [ "$skipped" = "$n" ] && rc=77
exit $rc
