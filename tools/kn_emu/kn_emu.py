#!/usr/bin/env python3
"""kn_emu.py IN.cu OUT.cpp: makes a kernels/*.cu file compile as host C++
against tools/kn_emu/include (the CPU emulation, README.md). Two rewrites:

  - every launch `k<<<grid, block[, smem[, stream]]>>>(args)` becomes
    `kn_emu_launch(k, dim3(grid), dim3(block), smem, args)` (smem 0 when
    absent; the stream is dropped: launches run at once);
  - every dynamic shared array `extern __shared__ [__align__(N)] T name[];`
    becomes `T *const name = reinterpret_cast<T *>(kn_emu_dyn_smem());`, the
    launch's buffer (16-byte aligned, refilled with garbage per block).

Everything else is compiled as written; the device code's few emulation hooks
are `#if defined(KN_EMU_DEVICE_HPP)` blocks in the .cu files themselves."""
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


def rewrite_launches(src):
    out, pos = [], 0
    for m in re.finditer(r'(\w+(?:\s*<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(', src, re.S):
        if m.start() < pos:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {'(': 1, ')': -1}.get(src[i], 0)
            i += 1
        cfg = split_top(m.group(2))
        if len(cfg) < 2 or len(cfg) > 4:
            sys.exit('kn_emu.py: launch configuration <<<%s>>> not understood' % m.group(2))
        smem = cfg[2] if len(cfg) > 2 else '0'
        args = src[m.end():i - 1]
        out.append(src[pos:m.start()])
        out.append('kn_emu_launch(%s, dim3(%s), dim3(%s), (size_t)(%s)%s)' %
                   (m.group(1), cfg[0], cfg[1], smem, ', ' + args if args.strip() else ''))
        pos = i
    out.append(src[pos:])
    return ''.join(out)


DYN = re.compile(r'extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([\w:\s\*]+?)\s*(\w+)\s*\[\s*\]\s*;')


def rewrite_dyn_smem(src):
    return DYN.sub(lambda m: '%s *const %s = reinterpret_cast<%s *>(kn_emu_dyn_smem());' %
                   (m.group(1).strip(), m.group(2), m.group(1).strip()), src)


if __name__ == '__main__':
    src = open(sys.argv[1]).read()
    open(sys.argv[2], 'w').write(rewrite_dyn_smem(rewrite_launches(src)))
