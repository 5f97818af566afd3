#!/usr/bin/env python3
"""kimi_pcre2_pattern: the committed PCRE2 form of Kimi's pre-tokenizer splits like the original.

Compiles tools/kimi/pcre2_split.c against libpcre2-8 (PCRE2_UTF | PCRE2_UCP, as the C tokenizer
must), runs tests/fixtures/kimi/pretokenize_pcre2.txt over the 500+ strings of
tests/fixtures/kimi/tokenizer_cases.json, and compares every piece boundary with the ones Python's
regex module (V1 mode, true class intersection) produced from Kimi's original `&&` pattern.
Skips (77) when no C compiler or libpcre2-8 is available.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
FIX = os.path.join(ROOT, "tests", "fixtures", "kimi")


def main() -> int:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not shutil.which("pkg-config"):
        print("skip: no C compiler or pkg-config")
        return 77
    pc = subprocess.run(["pkg-config", "--cflags", "--libs", "libpcre2-8"], capture_output=True, text=True)
    if pc.returncode != 0:
        print("skip: libpcre2-8 not found")
        return 77
    cases = json.load(open(os.path.join(FIX, "tokenizer_cases.json"), encoding="utf-8"))["cases"]
    pattern = open(os.path.join(FIX, "pretokenize_pcre2.txt"), encoding="utf-8").read().rstrip("\n")
    assert "&&" not in pattern and r"\p{Han}" not in pattern
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "pcre2_split")
        subprocess.run([cc, "-O1", "-o", exe, os.path.join(ROOT, "tools", "kimi", "pcre2_split.c")]
                       + pc.stdout.split(), check=True)
        pf, cf = os.path.join(d, "pat"), os.path.join(d, "corpus")
        with open(pf, "w", encoding="utf-8") as f:
            f.write(pattern + "\n")
        with open(cf, "wb") as f:
            for c in cases:
                b = c["text"].encode()
                f.write(b"%d\n" % len(b) + b)
        out = subprocess.run([exe, pf, cf], check=True, capture_output=True).stdout.decode()
    lines = out.split("\n")[:-1]
    assert len(lines) == len(cases), (len(lines), len(cases))
    bad = 0
    for c, ln in zip(cases, lines):
        spans = [tuple(int(x) for x in sp.split(":")) for sp in ln.split()]
        starts = [0] + c["split_ends"][:-1]
        want = list(zip(starts, c["split_ends"]))
        if spans != want:
            bad += 1
            if bad <= 5:
                print("MISMATCH", repr(c["text"]), "pcre2", spans, "expected", want)
    assert bad == 0, f"{bad} of {len(cases)} strings split differently"
    print(f"kimi pcre2 pattern: {len(cases)} strings split identically to regex(V1) on the original")
    return 0


if __name__ == "__main__":
    sys.exit(main())
