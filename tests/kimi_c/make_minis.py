#!/usr/bin/env python3
"""make_minis.py: the kimi_c_mini_setup fixture: regenerates the seed-0 Kimi miniature (numpy only,
tools/kimi/make_mini.py) in the three tensor-name layouts the C loader accepts, under OUT:

    OUT/k25      language_model.model.* + language_model.lm_head (Kimi-K2.5), tokenizer files
    OUT/nomodel  language_model.* (re-exports without ".model"), text_config model_type deepseek_v3
    OUT/dsv3     plain DeepseekV3 config and model.* / lm_head.weight names

All three hold the same numbers (values depend only on seed and canonical name). A stamp with the
sha256 of make_mini.py skips regeneration when nothing changed. Exits 77 (skip) without numpy.
"""
import hashlib
import os
import sys

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def main() -> int:
    out = sys.argv[1]
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("SKIP: numpy not available to regenerate the Kimi miniature")
        return 77
    sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
    import make_mini as mm
    gen = os.path.join(ROOT, "tools", "kimi", "make_mini.py")
    stamp_text = hashlib.sha256(open(gen, "rb").read()).hexdigest() + " seed 0 v1\n"
    stamp = os.path.join(out, "stamp")
    if os.path.exists(stamp) and open(stamp).read() == stamp_text:
        print(f"miniatures in {out} are current")
        return 0
    os.makedirs(out, exist_ok=True)
    if os.path.exists(stamp):
        os.remove(stamp)
    have_tok = os.path.exists(os.path.join(mm.KIMI_DATA, "tiktoken.model"))
    if not have_tok:
        print(f"note: {mm.KIMI_DATA}/tiktoken.model missing: the miniature gets no tokenizer files")
    mm.make(0, os.path.join(out, "k25"), "kimi_k2", "kimi_k25", have_tok)
    mm.make(0, os.path.join(out, "nomodel"), "deepseek_v3", "kimi_k25_nomodel", False)
    mm.make(0, os.path.join(out, "dsv3"), "deepseek_v3", "deepseek_v3", False)
    with open(stamp, "w") as f:
        f.write(stamp_text)
    print(f"wrote the seed-0 miniature in 3 layouts under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
