#!/bin/sh
# ptxas_tee.sh COMPILER ARGS...: the compiler launcher of specd_kernels. Runs
# the compile unchanged and keeps its `ptxas -v` report (registers, stack,
# spills per kernel) in <object>.ptxas, where tests/kernels/kn_spill_check.cmake
# reads it; every other diagnostic still goes to stderr.
obj=""
prev=""
for a in "$@"; do
    [ "$prev" = "-o" ] && obj="$a"
    prev="$a"
done
[ -n "$obj" ] || exec "$@"
"$@" 2>"$obj.ptxas.tmp"
rc=$?
grep -v -e '^ptxas info' -e 'bytes stack frame' "$obj.ptxas.tmp" >&2
mv -f "$obj.ptxas.tmp" "$obj.ptxas"
exit $rc
