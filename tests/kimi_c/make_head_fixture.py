#!/usr/bin/env python3
"""make_head_fixture.py (kimi_c_head_setup): the Kimi miniature's EAGLE-3 head, built as a user
would build it, checked against independent references on the way. Under OUT (the kimi_c_mini
directory, made by make_minis.py):

  1. `specd vocab count --target OUT/k25 --data GSM8K train` (the miniature's Kimi tokenizer and
     chat template, assistant loss mask) -> OUT/kimi_vocab/freq.npy; its sha256 and totals must
     equal tests/fixtures/kimi/draft_vocab_ref.json, counted by tools/kimi/vocab_ref.py with the
     `tiktoken` package + jinja2 (no specd code);
  2. `specd vocab build --draft-vocab-size 32000 --target OUT/k25` -> OUT/kimi_vocab/map; d2t and
     t2d must equal the reference's numpy selection (sha256 of the int64 offsets and the bool
     mask, first/last kept ids);
  3. tools/kimi/make_head.py (numpy, seed 0) writes OUT/kimi_head with that map; its bytes must
     equal tests/fixtures/kimi/head_seed0_sha256.json (regeneration is deterministic);
  4. `specd vocab inspect OUT/kimi_head --target OUT/k25` must accept the head's map;
  5. OUT/kimi_head_bad/<mode>: heads the loader must refuse (make_head.BAD), with the expected
     phrase of each refusal in OUT/kimi_head_bad.json (kimi_c_spec loads them).

Needs ../shared/data (the Kimi tokenizer in OUT/k25 and prompts/gsm8k_train.jsonl) and the specd
binary: without them it prints why and exits 77 (kimi_c_spec then uses the random head).
A stamp (sha256 of the scripts, the fixture and the data) skips the work when nothing changed.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
BUILD = os.environ.get("SPECD_BUILD_DIR", "")
FIX = os.path.join(ROOT, "tests", "fixtures", "kimi")


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 20), b""):
            h.update(blk)
    return h.hexdigest()


def child_env() -> dict:
    """The environment for the specd children. Under the CI sanitizer stage (ASAN_OPTIONS with
    strict_string_checks=1) a Kimi tokenizer load takes minutes: ASan's strtol interceptor then
    scans to the end of the whole 2.6 MB ranks buffer on each of the 163,584 lines (tiktoken.c
    parses ranks in place). The children run without that one option; every other check stays."""
    env = dict(os.environ)
    a = env.get("ASAN_OPTIONS")
    if a and "strict_string_checks=1" in a:
        env["ASAN_OPTIONS"] = a.replace("strict_string_checks=1", "strict_string_checks=0")
    return env


def run(cmd: list) -> str:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    print("$ " + " ".join(cmd))
    print(p.stdout.rstrip())
    if p.returncode != 0:
        raise SystemExit(f"FAIL: exit {p.returncode}")
    return p.stdout


def main() -> int:
    out = sys.argv[1]
    specd = os.path.join(BUILD, "server", "specd")
    prompts = os.environ.get("SPECD_PROMPTS_DIR", os.path.join(os.path.dirname(ROOT), "shared", "data", "prompts"))
    data = os.path.join(prompts, "gsm8k_train.jsonl")
    target = os.path.join(out, "k25")
    hdir = os.path.join(out, "kimi_head")
    for need, why in ((specd, "the specd binary"), (data, "GSM8K train (../shared/data/prompts)"),
                      (os.path.join(target, "tiktoken.model"), "the miniature's Kimi tokenizer (../shared/data/kimi-k2)")):
        if not os.path.exists(need):
            print(f"SKIP: {need} missing ({why})")
            shutil.rmtree(hdir, ignore_errors=True)   # no stale head: kimi_c_spec falls back to the random one
            return 77
    try:
        import numpy as np
    except ImportError:
        print("SKIP: numpy not available")
        return 77
    ref = json.load(open(os.path.join(FIX, "draft_vocab_ref.json")))
    want_head = json.load(open(os.path.join(FIX, "head_seed0_sha256.json")))
    gen = os.path.join(ROOT, "tools", "kimi", "make_head.py")
    stamp_text = hashlib.sha256(open(gen, "rb").read() + open(__file__, "rb").read() +
                                json.dumps([ref, want_head]).encode() + sha(specd).encode()).hexdigest() + "\n"
    stamp = os.path.join(out, "kimi_head.stamp")
    if os.path.exists(stamp) and open(stamp).read() == stamp_text:
        print(f"{out}/kimi_head is current")
        return 0
    if os.path.exists(stamp):
        os.remove(stamp)
    bad = []
    if sha(data) != ref["data_sha256"]:
        print(f"SKIP: {data} is not the file the reference counted (sha256 differs)")
        shutil.rmtree(hdir, ignore_errors=True)
        return 77

    vdir = os.path.join(out, "kimi_vocab")
    os.makedirs(vdir, exist_ok=True)
    freq_path = os.path.join(vdir, "freq.npy")
    log = run([specd, "vocab", "count", "--target", target, "--data", data, "--output", freq_path])
    freq = np.load(freq_path)
    got = {"freq_sha256": hashlib.sha256(freq.astype("<i8").tobytes()).hexdigest(),
           "assistant_tokens": int(freq.sum()), "distinct": int((freq > 0).sum())}
    for k, v in got.items():
        if v != ref[k]:
            bad.append(f"count: {k} = {v}, reference {ref[k]}")
    if f"tokens: {ref['total_tokens']} total" not in log:
        bad.append(f"count: total tokens differ from the reference's {ref['total_tokens']}")
    order = np.lexsort((np.arange(len(freq)), -freq))
    top = [[int(i), int(freq[i])] for i in order[:50]]
    if top != ref["top50"]:
        bad.append(f"count: top-50 differ, first specd {top[:3]} reference {ref['top50'][:3]}")

    mdir = os.path.join(vdir, "map")
    run([specd, "vocab", "build", "--token-freq", freq_path, "--draft-vocab-size", str(ref["draft_vocab"]),
         "--target", target, "--output-dir", mdir])
    d2t = np.load(os.path.join(mdir, "d2t.npy"))
    t2d = np.load(os.path.join(mdir, "t2d.npy"))
    used = np.arange(len(d2t), dtype=np.int64) + d2t
    checks = {"d2t_sha256": hashlib.sha256(d2t.astype("<i8").tobytes()).hexdigest(),
              "t2d_sha256": hashlib.sha256(t2d.astype(np.uint8).tobytes()).hexdigest(),
              "used_first20": [int(x) for x in used[:20]], "used_last20": [int(x) for x in used[-20:]]}
    for k, v in checks.items():
        if v != ref[k]:
            bad.append(f"build: {k} differs from the reference ({str(v)[:80]} vs {str(ref[k])[:80]})")

    sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
    import make_head
    make_head.check_target(target)
    sums = make_head.make(0, mdir, hdir)
    for f, s in sums.items():
        if s != want_head[f]:
            bad.append(f"head: {f} sha256 {s}, expected {want_head[f]} (generator not deterministic?)")
    run([specd, "vocab", "inspect", hdir, "--target", target])
    bad_root = os.path.join(out, "kimi_head_bad")
    with open(os.path.join(bad_root + ".json"), "w") as f:
        json.dump(make_head.make_bad(0, mdir, bad_root), f, indent=1)

    if bad:
        for b in bad:
            print("FAIL: " + b)
        return 1
    print(f"kimi_c_head_setup: specd vocab on {ref['n_records']} GSM8K records == tiktoken/jinja2 reference "
          f"({ref['assistant_tokens']} assistant tokens, {ref['distinct']} distinct ids, {ref['filled']} filled); "
          f"head written to {hdir}")
    with open(stamp, "w") as f:
        f.write(stamp_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
