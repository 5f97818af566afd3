#!/usr/bin/env python3
"""regen_heads.py: regenerate the random EAGLE-3 heads the fixtures were made with.

What it owns: nothing on disk but OUT/<name>/ (one head per fixture head of
tests/fixtures/eagle3/draft_fixtures.json, plus OUT/vocab_<mode>/ for every
vocabulary-map test head: five the loader must refuse, identity-zeros it
must accept).  Each head is ~47 MB; --only limits the set.  numpy + the standard library only, so CI (project .venv) can
run it before the C draft tests.  Each fixture head's model.safetensors and
config.json are checked against the sha256 recorded when the fixtures were
made: a mismatch means the generator or numpy's stream changed and the
fixtures no longer describe these heads; exit status 1 then.

Usage: regen_heads.py [--fixtures tests/fixtures/eagle3/draft_fixtures.json] --out DIR
                     [--only NAME[,NAME...]] [--no-refusal-heads]
Prints one line per head: name, directory, "ok" / "MISMATCH".
"""

import argparse
import hashlib
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_random_head as mrh  # noqa: E402


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def run_cmd(cmd: str, out: str):
    """Execute a recorded make_random_head.py command line in-process."""
    argv = shlex.split(cmd.replace("DIR", shlex.quote(out)))[1:]
    old = sys.argv
    try:
        sys.argv = ["make_random_head.py"] + argv
        mrh.main()
    finally:
        sys.argv = old


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(here, "..", "..", "tests", "fixtures",
                                                       "eagle3", "draft_fixtures.json"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-refusal-heads", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of head names (spec_s1, vocab_no-d2t, ...)")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    with open(a.fixtures) as f:
        meta = json.load(f)
    bad = 0
    for name, h in meta["heads"].items():
        if only is not None and name not in only:
            continue
        d = os.path.join(a.out, name)
        run_cmd(h["make_head"], d)
        ok = (sha256(os.path.join(d, "model.safetensors")) == h["model_safetensors_sha256"]
              and sha256(os.path.join(d, "config.json")) == h["config_json_sha256"])
        bad += not ok
        print(f"{name} {d} {'ok' if ok else 'MISMATCH'}")
    if not a.no_refusal_heads:
        for mode, r in meta.get("refusal_heads", {}).items():
            if only is not None and "vocab_" + mode not in only:
                continue
            d = os.path.join(a.out, "vocab_" + mode)
            run_cmd(r["make_head"], d)
            print(f"vocab_{mode} {d} written")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
