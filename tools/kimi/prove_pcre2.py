#!/usr/bin/env python3
"""prove_pcre2.py: Kimi's pre-tokenizer pattern rewritten for PCRE2, and the proof it splits alike.

What it owns
    tests/fixtures/kimi/pretokenize_pcre2.txt (the rewritten pattern, one line) and the evidence
    that PCRE2 running it splits text exactly as Kimi's own pattern does under the engines that
    understand class intersection. Kimi's pattern uses `[A B C&&[^\\p{Han}]]` (Rust regex /
    Java syntax: "letters of these categories, excluding Han script"). PCRE2 10.42 compiles that
    without error but reads `&&[^...` as literal characters inside a class followed by a second
    class, so it must be rewritten; here each intersection becomes a negative lookahead:
        [\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]  ->  (?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])
        [\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]         ->  (?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])
    and every \\p{Han} becomes \\p{sc:Han}: since 10.40 PCRE2 reads \\p{Han} as Script_Extensions
    (so it also matches 。、「」〜 and other CJK punctuation shared with Han), while Rust regex, and
    therefore tiktoken and Kimi, read \\p{Han} as the Script property; \\p{sc:Han} is Script in
    PCRE2 (and accepted with the same meaning by Rust regex and Python's regex module).
    The C side must compile it with PCRE2_UTF | PCRE2_UCP (without UCP, \\s, \\p and case-folding
    fall back to ASCII rules).

The proof, on the tokenizer corpus of gen_tok_fixtures.py plus a seeded random corpus over
characters chosen around the Han boundary (々 〻 are Lm yet Script=Han, 〇 is Nl and Han, CJK
extensions, compatibility ideographs, kana, Hangul, titlecase and modifier letters, combining
marks, Unicode digits and whitespace):
    A. pieces of the ORIGINAL pattern by the `regex` module in V1 mode (true set intersection)
    B. pieces of the REWRITTEN pattern by real PCRE2 10.42 (tools/kimi/pcre2_split.c)
    C. ids of tiktoken (Rust fancy-regex) with the original pattern, with the rewritten pattern,
       and by BPE-ing the PCRE2 pieces one by one (tiktoken's _encode_single_piece)
    A == B and the three id lists agree on every string; the script fails otherwise. It also
    counts how many strings the NAIVE pattern (the && form fed to PCRE2 as is) splits wrongly.

Usage: prove_pcre2.py [--write]   (venv-tools: regex, tiktoken; needs cc and libpcre2-8)
Threading: single-threaded.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile

import regex

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_tok_fixtures as gtf  # noqa: E402
import kimi_tok as kt  # noqa: E402

INTER_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
INTER_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
REWRITE_UPPER = r"(?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
REWRITE_LOWER = r"(?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"
HAN_RUN, HAN_RUN_PCRE2 = r"[\p{Han}]+", r"[\p{sc:Han}]+"


def pcre2_pattern() -> str:
    p = kt.PATTERN
    assert p.count(INTER_UPPER) == 2 and p.count(INTER_LOWER) == 2
    p = p.replace(INTER_UPPER, REWRITE_UPPER).replace(INTER_LOWER, REWRITE_LOWER)
    assert p.startswith(HAN_RUN + "|")
    p = HAN_RUN_PCRE2 + p[len(HAN_RUN):]
    assert "&&" not in p and r"\p{Han}" not in p
    return p


POOL = (
    "aZéÉßſǅǈǋʰʲˈΑαЖжאבعربक्षนาｱｶｷｧ"          # Latin, titlecase, modifier, Greek, Cyrillic, Hebrew, ...
    "\u0301\u0308\u0903\u093f\u20dd"                 # combining marks (Mn, Mc, Me)
    "中国字漢〇々〻㐀𠀀豈丽"                               # Han: unified, Nl, Lm (Han script), ext A/B, compat
    "ぁあゝゞァアーヽ"                                 # kana (Lo, Lm; not Han)
    "한국ㄱㅏ"                                        # Hangul
    "0123٣۴७①²½Ⅻ１"                                  # digits and other numbers
    " \t\n\r\u00a0\u3000\u2009\u2028\u0085\u200b"     # whitespace (and ZWSP, which is not)
    ".,!?'\"’-_()[]{}<>@#$%&*+/\\|~`^:;=，。！？「」—…"
    "😀👍🏽\u200d❤️🇫🇷"                                   # emoji, ZWJ, VS16, regional indicators
    "'s'S'RE'll'M'D"
)


def random_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chars = list(POOL)
    out = []
    for _ in range(n):
        k = rng.randint(1, 14)
        out.append("".join(rng.choice(chars) for _ in range(k)))
    return out


def pcre2_spans(binary: str, pattern: str, texts: list[str]) -> list[list[tuple[int, int]]]:
    with tempfile.TemporaryDirectory() as d:
        pf, cf = os.path.join(d, "pat"), os.path.join(d, "corpus")
        with open(pf, "wb") as f:
            f.write(pattern.encode() + b"\n")
        with open(cf, "wb") as f:
            for t in texts:
                b = t.encode()
                f.write(b"%d\n" % len(b) + b)
        out = subprocess.run([binary, pf, cf], check=True, capture_output=True).stdout.decode()
    lines = out.split("\n")[:-1]
    assert len(lines) == len(texts), (len(lines), len(texts))
    return [[tuple(int(x) for x in sp.split(":")) for sp in ln.split()] for ln in lines]


def pieces_from_spans(text: str, spans) -> list[bytes]:
    b = text.encode()
    return [b[a:e] for a, e in spans]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="write tests/fixtures/kimi/pretokenize_pcre2.txt")
    ap.add_argument("--random", type=int, default=4000)
    a = ap.parse_args(argv)
    pat = pcre2_pattern()
    texts = gtf.corpus() + random_corpus(a.random, 7)
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "pcre2_split")
        cflags = subprocess.run(["pkg-config", "--cflags", "--libs", "libpcre2-8"], check=True,
                                capture_output=True, text=True).stdout.split()
        subprocess.run(["cc", "-O1", "-o", exe, os.path.join(HERE, "pcre2_split.c")] + cflags, check=True)
        spans = pcre2_spans(exe, pat, texts)
        naive = pcre2_spans(exe, kt.PATTERN, texts)
    orig_v1 = regex.compile("(?V1)" + kt.PATTERN)
    rew_v0 = regex.compile(pat)
    enc_orig = kt.encoding()
    enc_rew = kt.encoding(pat)
    n_naive_bad = 0
    for t, sp, nv in zip(texts, spans, naive):
        a_pieces = [m.group().encode() for m in orig_v1.finditer(t)]
        b_pieces = pieces_from_spans(t, sp)
        assert b"".join(b_pieces) == t.encode(), ("PCRE2 pieces do not cover", t)
        assert a_pieces == b_pieces, ("regex(V1, original) != PCRE2(rewrite)", t, a_pieces, b_pieces)
        assert [m.group().encode() for m in rew_v0.finditer(t)] == b_pieces, ("regex(rewrite)", t)
        ids = enc_orig.encode_ordinary(t)
        assert enc_rew.encode_ordinary(t) == ids, ("tiktoken(rewrite) != tiktoken(original)", t)
        ids_pcre2 = [i for p in b_pieces for i in enc_orig._encode_single_piece(p)]
        assert ids_pcre2 == ids, ("BPE(PCRE2 pieces) != tiktoken", t)
        if pieces_from_spans(t, nv) != b_pieces:
            n_naive_bad += 1
    # the hazards, pinned: the naive && form matches "A]" but not "ABC"; \p{Han} takes "。"
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "pcre2_split")
        subprocess.run(["cc", "-O1", "-o", exe, os.path.join(HERE, "pcre2_split.c")] + cflags, check=True)
        hz = pcre2_spans(exe, r"[\p{Lu}&&[^\p{Han}]]+", ["A]", "ABC"])
        hz2 = pcre2_spans(exe, r"[\p{Han}]+", ["我。"])
        hz3 = pcre2_spans(exe, r"[\p{sc:Han}]+", ["我。"])
    assert hz == [[(0, 2)], []], hz
    assert hz2 == [[(0, 6)]] and hz3 == [[(0, 3)]], (hz2, hz3)
    print(f"PCRE2 hazards: [\\p{{Lu}}&&[^\\p{{Han}}]]+ on 'A]' / 'ABC' -> {hz}; "
          f"[\\p{{Han}}]+ on '我。' -> {hz2} (Script_Extensions), [\\p{{sc:Han}}]+ -> {hz3}")
    print(f"{len(texts)} strings: regex-V1(original) == PCRE2(rewrite) pieces; tiktoken ids equal for "
          f"original, rewrite and BPE of PCRE2 pieces. The naive pattern under PCRE2 splits "
          f"{n_naive_bad} of them differently.")
    if a.write:
        p = os.path.join(kt.REPO, "tests", "fixtures", "kimi", "pretokenize_pcre2.txt")
        with open(p, "w", encoding="utf-8") as f:
            f.write(pat + "\n")
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
