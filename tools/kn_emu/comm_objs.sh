# tools/kn_emu/comm_objs.sh, sourced by run_comm.sh and run_tp.sh: builds the
# cuda_ipc collectives against the emulation into $out: kn_allreduce.cu
# rewritten by kn_emu.py (kn_allreduce.o), the emulated runtime
# (kn_emu_runtime.o) and one object per engine/comm/*.c, whose paths it
# leaves in $objs. Needs here, root, out, CC, CXX and inc set by the caller.
python3 "$here/kn_emu.py" "$root/kernels/kn_allreduce.cu" "$out/kn_allreduce.cpp"
$CXX -std=c++17 -O2 -g -Wall -Wno-unused-function $inc -c "$out/kn_allreduce.cpp" -o "$out/kn_allreduce.o"
$CXX -std=c++17 -O2 -g -Wall $inc -c "$here/kn_emu_runtime.cpp" -o "$out/kn_emu_runtime.o"
objs=""
for c in "$root"/engine/comm/*.c; do
    o="$out/comm_$(basename "$c" .c).o"
    $CC -std=gnu17 -O2 -g -Wall -Werror -ffp-contract=off -DSPECD_HAVE_CUDA=1 $inc -c "$c" -o "$o"
    objs="$objs $o"
done
