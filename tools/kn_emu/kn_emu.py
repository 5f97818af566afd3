#!/usr/bin/env python3
"""kn_emu.py IN.cu OUT.cpp: rewrites every `k<<<grid, block, smem, stream>>>(args)`
launch of a kernels/*.cu file into `kn_emu_launch(k, grid, block, args)` so the
file compiles as host C++ against tools/kn_emu/include (the CPU emulation)."""
import re
import sys


def split_top(s):
    parts, depth, cur = [], 0, ''
    for ch in s:
        if ch in '([{':
            depth += 1
        elif ch in ')]}':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur.strip())
            cur = ''
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


src = open(sys.argv[1]).read()
out, pos = [], 0
for m in re.finditer(r'(\w+)\s*<<<(.*?)>>>\s*\(', src, re.S):
    if m.start() < pos:
        continue
    depth, i = 1, m.end()
    while depth:
        depth += {'(': 1, ')': -1}.get(src[i], 0)
        i += 1
    cfg = split_top(m.group(2))
    args = src[m.end():i - 1]
    out.append(src[pos:m.start()])
    out.append('kn_emu_launch(%s, dim3(%s), dim3(%s)%s)' % (m.group(1), cfg[0], cfg[1], ', ' + args if args.strip() else ''))
    pos = i
out.append(src[pos:])
open(sys.argv[2], 'w').write(''.join(out))
