#!/usr/bin/env python3
"""`specd vocab` end to end against numpy and safetensors (project venv only).

- build: the frequency vector is written by numpy (np.save), the outputs are
  read back by numpy (d2t.npy, t2d.npy) and by the `safetensors` package
  (vocab_map.safetensors: tensors d2t int64 and t2d bool), and compared with
  the selection rule implemented here in numpy (most frequent, ties by lower
  id, forced ids, fill with the lowest unused ids): a hand example and random
  vectors with many ties.
- refusals: wrong dtype, wrong rank, wrong length, negative counts, draft size
  0 and >= target, a truncated .npy, each with its message and exit code 1.
- inspect: a good map (offsets), d2t written as absolute ids, d2t missing.
- with the SmolLM2 GGUF: build --target forces <|im_start|>/<|im_end|>; count
  reports malformed JSONL lines by number and processes the rest.
Skips (77) when the specd binary has not been built.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

BUILD = os.environ.get("SPECD_BUILD_DIR", "build")
SPECD = os.path.join(BUILD, "server", "specd")
MODEL = os.environ.get("SPECD_MODEL_GGUF", "")


def run(*args):
    p = subprocess.run([SPECD, "vocab", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def ref_build(freq, n, forced=(), avoid=None):
    v = len(freq)
    kept = np.zeros(v, dtype=bool)
    kept[list(forced)] = True
    seen = np.nonzero(freq > 0)[0]
    order = seen[np.lexsort((seen, -freq[seen]))]  # count descending, then id ascending
    slots = n - int(kept.sum())
    take = [i for i in order if not kept[i]][:slots]
    kept[take] = True
    slots -= len(take)
    for avoid_pass in ([True, False] if avoid is not None else [False]):
        for i in range(v):
            if slots == 0:
                break
            if not kept[i] and not (avoid_pass and avoid[i]):
                kept[i] = True
                slots -= 1
    used = np.nonzero(kept)[0]
    return used - np.arange(n), kept


def check_outputs(d, d2t_ref, t2d_ref):
    d2t = np.load(os.path.join(d, "d2t.npy"))
    t2d = np.load(os.path.join(d, "t2d.npy"))
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_, (d2t.dtype, t2d.dtype)
    assert np.array_equal(d2t, d2t_ref), "d2t.npy differs from the numpy rule"
    assert np.array_equal(t2d, t2d_ref), "t2d.npy differs from the numpy rule"
    st = load_file(os.path.join(d, "vocab_map.safetensors"))
    assert set(st) == {"d2t", "t2d"}
    assert st["d2t"].dtype == np.int64 and st["t2d"].dtype == np.bool_
    assert st["d2t"].shape == d2t_ref.shape and st["t2d"].shape == t2d_ref.shape
    assert np.array_equal(st["d2t"], d2t_ref) and np.array_equal(st["t2d"], t2d_ref)
    # the EAGLE-3 use: target = draft + d2t[draft], and t2d marks exactly those
    used = np.arange(len(d2t_ref)) + st["d2t"]
    assert np.all(np.diff(used) > 0) and st["t2d"].sum() == len(used) and st["t2d"][used].all()
    with safe_open(os.path.join(d, "vocab_map.safetensors"), framework="np") as f:
        meta = f.metadata()
    assert meta["draft_vocab_size"] == str(len(d2t_ref)) and meta["target_vocab_size"] == str(len(t2d_ref))


def test_build(tmp):
    # hand example (see tests/vocab/test_vocab_build.c): used [1 2 3 6 9], d2t [1 1 1 3 5]
    freq = np.array([0, 5, 3, 5, 0, 1, 7, 3, 0, 0, 2, 0], dtype=np.int64)
    np.save(os.path.join(tmp, "f.npy"), freq)
    rc, out, err = run("build", "--token-freq", os.path.join(tmp, "f.npy"), "--draft-vocab-size", "5",
                       "--always-include", "9", "--output-dir", os.path.join(tmp, "hand"))
    assert rc == 0, err
    d2t_ref, t2d_ref = ref_build(freq, 5, [9])
    assert d2t_ref.tolist() == [1, 1, 1, 3, 5]
    check_outputs(os.path.join(tmp, "hand"), d2t_ref, t2d_ref)
    assert "coverage: 76.9231% of the assistant-token frequency (20 of 26)" in out, out
    assert "1 of them not kept by frequency alone" in out, out

    rng = np.random.default_rng(7)
    for k, (v, n, n_seen) in enumerate([(5000, 1200, 3000), (3000, 2000, 500), (100, 99, 100)]):
        freq = np.zeros(v, dtype=np.int64)
        ids = rng.choice(v, n_seen, replace=False)
        freq[ids] = rng.integers(1, 6, n_seen)  # few distinct counts: many ties
        forced = sorted(set(rng.choice(v, 4, replace=False).tolist()))
        np.save(os.path.join(tmp, f"r{k}.npy"), freq)
        rc, out, err = run("build", "--token-freq", os.path.join(tmp, f"r{k}.npy"), "--draft-vocab-size", str(n),
                           "--target-vocab-size", str(v), "--always-include", ",".join(map(str, forced)),
                           "--output-dir", os.path.join(tmp, f"r{k}"))
        assert rc == 0, err
        d2t_ref, t2d_ref = ref_build(freq, n, forced)
        check_outputs(os.path.join(tmp, f"r{k}"), d2t_ref, t2d_ref)
        if n > n_seen + len(forced):
            assert "fewer distinct ids were seen" in out, out
        # inspect reads all three forms back
        for p in ["", "vocab_map.safetensors", "d2t.npy"]:
            rc, out, err = run("inspect", os.path.join(tmp, f"r{k}", p))
            assert rc == 0 and "detected: offsets" in out and "verdict: OK" in out, (out, err)


def test_refusals(tmp):
    good = np.arange(10, dtype=np.int64)

    def refused(arr_or_bytes, args, needle, name):
        p = os.path.join(tmp, name)
        if isinstance(arr_or_bytes, bytes):
            open(p, "wb").write(arr_or_bytes)
        else:
            np.save(p, arr_or_bytes)
        rc, out, err = run("build", "--token-freq", p, *args, "--output-dir", os.path.join(tmp, "no"))
        assert rc == 1 and needle in err, (name, rc, err)

    refused(good.astype(np.float64), ["--draft-vocab-size", "4"], "the file holds dtype '<f8'", "f8.npy")
    refused(good.astype(np.int32), ["--draft-vocab-size", "4"], "the file holds dtype '<i4'", "i4.npy")
    refused(good.astype(np.uint64), ["--draft-vocab-size", "4"], "the file holds dtype '<u8'", "u8.npy")
    refused(good.astype(">i8"), ["--draft-vocab-size", "4"], "unsupported dtype '>i8'", "be.npy")
    refused(good.reshape(2, 5), ["--draft-vocab-size", "4"], "must be 1-D", "2d.npy")
    refused(good, ["--draft-vocab-size", "4", "--target-vocab-size", "12"], "has 10 entries, the target vocab has 12",
            "len.npy")
    neg = good.copy()
    neg[7] = -1
    refused(neg, ["--draft-vocab-size", "4"], "negative count -1 at id 7", "neg.npy")
    refused(good, ["--draft-vocab-size", "0"], "at least 1", "zero.npy")
    refused(good, ["--draft-vocab-size", "10"], "must be smaller than the target vocab size 10", "eq.npy")
    refused(good, ["--draft-vocab-size", "11"], "must be smaller than the target vocab size 10", "gt.npy")
    np.save(os.path.join(tmp, "t.npy"), good)
    raw = open(os.path.join(tmp, "t.npy"), "rb").read()
    refused(raw[:-3], ["--draft-vocab-size", "4"], "needs 80 bytes of data, the file has 77", "short.npy")
    refused(raw[:40], ["--draft-vocab-size", "4"], "exceeds the file", "cut.npy")
    assert not os.path.exists(os.path.join(tmp, "no"))
    rc, _, err = run("build", "--token-freq", os.path.join(tmp, "t.npy"), "--draft-vocab-size", "x", "--output-dir", tmp)
    assert rc == 2 and "expects an integer" in err


def test_inspect_bad(tmp):
    v, n = 50, 10
    used = np.array([0, 3, 4, 7, 10, 11, 20, 30, 40, 49])
    t2d = np.zeros(v, dtype=bool)
    t2d[used] = True
    d = os.path.join(tmp, "abs")
    os.makedirs(d)
    np.save(os.path.join(d, "d2t.npy"), used.astype(np.int64))  # absolute ids: the field bug
    np.save(os.path.join(d, "t2d.npy"), t2d)
    rc, out, err = run("inspect", d)
    assert rc == 1 and "detected: ABSOLUTE ids" in out and "looks like absolute ids" in out, (out, err)
    d = os.path.join(tmp, "ok")
    os.makedirs(d)
    np.save(os.path.join(d, "d2t.npy"), (used - np.arange(n)).astype(np.int64))
    np.save(os.path.join(d, "t2d.npy"), t2d)
    rc, out, err = run("inspect", d)
    assert rc == 0 and "detected: offsets" in out and "draft 9 -> target 49 (d2t 40)" in out, (out, err)
    os.remove(os.path.join(d, "d2t.npy"))
    rc, out, err = run("inspect", d)
    assert rc == 1 and "has no d2t: refusing" in out, (out, err)
    t2d[5] = True  # t2d disagreeing with d2t
    np.save(os.path.join(d, "d2t.npy"), (used - np.arange(n)).astype(np.int64))
    np.save(os.path.join(d, "t2d.npy"), t2d)
    rc, out, err = run("inspect", d)
    assert rc == 1 and "t2d is inconsistent with d2t" in out, (out, err)


def test_with_model(tmp):
    if not os.path.exists(MODEL):
        print("skip model part: no", MODEL)
        return
    v = 49152
    freq = np.zeros(v, dtype=np.int64)
    freq[1000:1010] = 5
    np.save(os.path.join(tmp, "m.npy"), freq)
    rc, out, err = run("build", "--token-freq", os.path.join(tmp, "m.npy"), "--draft-vocab-size", "100",
                       "--target", MODEL, "--output-dir", os.path.join(tmp, "m"))
    assert rc == 0, err
    t2d = np.load(os.path.join(tmp, "m", "t2d.npy"))
    assert t2d[1] and t2d[2] and t2d[1000:1010].all(), "forced <|im_start|>/<|im_end|> or counted ids missing"
    assert '"<|im_end|>"' in out and "fill:" in out, out
    rc, out, err = run("inspect", os.path.join(tmp, "m"), "--target", MODEL)
    assert rc == 0 and '-> target 2 (d2t 1) "<|im_end|>"' in out, out
    # wrong length against the target
    rc, out, err = run("build", "--token-freq", os.path.join(tmp, "t.npy"), "--draft-vocab-size", "4",
                       "--target", MODEL, "--output-dir", os.path.join(tmp, "no2"))
    assert rc == 1 and "has 10 entries, the target vocab has 49152" in err, err
    # count: malformed lines reported by number, the rest processed
    data = os.path.join(tmp, "d.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
        f.write(json.dumps({"prompt": "Hi", "response": "Hello there"}) + "\n")
        f.write(json.dumps({"turns": ["no answer"], "question_id": 3}) + "\n")
    out_npy = os.path.join(tmp, "c.npy")
    rc, out, err = run("count", "--target", MODEL, "--data", data, "--output", out_npy)
    assert rc == 0, err
    assert f"{data}:2: invalid JSON" in err and f"{data}:3: message 0" in err, err
    assert "3 records, 2 processed" in out and "1 without an assistant response" in out, out
    c = np.load(out_npy)
    assert c.dtype == np.int64 and c.shape == (v,) and c.sum() > 0 and c[2] == 2, (c.dtype, c.shape, c[2])
    rc, out, err = run("count", "--target", MODEL, "--data", os.path.join(tmp, "missing.jsonl"))
    assert rc == 1
    test_validate(tmp, data, out_npy)


def test_validate(tmp, data, freq_npy):
    """validate's held-out coverage equals numpy's on count's vector and the
    map; a one-record greedy run produces and saves an answer."""
    rc, out, err = run("build", "--token-freq", freq_npy, "--draft-vocab-size", "200", "--target", MODEL,
                       "--output-dir", os.path.join(tmp, "vm"))
    assert rc == 0, err
    other = os.path.join(tmp, "other.jsonl")
    with open(other, "w") as f:
        f.write(json.dumps({"prompt": "Name an animal.", "response": "Zebras quietly sing 42 songs.",
                            "category": "zoo"}) + "\n")
        f.write(json.dumps({"question": "2+2?", "answer": "4, of course", "category": "math"}) + "\n")
    rc, out, err = run("count", "--target", MODEL, "--data", other, "--output", os.path.join(tmp, "o.npy"))
    assert rc == 0, err
    c = np.load(os.path.join(tmp, "o.npy"))
    t2d = np.load(os.path.join(tmp, "vm", "t2d.npy"))
    want = 100.0 * c[t2d].sum() / c.sum()
    assert 0 < want < 100, want  # some tokens in, some out: the figure is not trivial
    rc, out, err = run("validate", "--draft", os.path.join(tmp, "vm"), "--target", MODEL, "--data", other,
                       "--no-greedy")
    assert rc == 0, err
    assert f"{c.sum()} assistant tokens, coverage {want:.4f}% ({c.sum() - c[t2d].sum()} not proposable)" in out, \
        (out, want)
    assert "held-out zoo" in out and "held-out math" in out, out
    rc, out, err = run("validate", "--draft", os.path.join(tmp, "vm"), "--target", MODEL, "--data", data,
                       "--no-greedy")
    assert rc == 0 and "coverage 100.0000%" in out, out  # the map was built from this very data
    q = os.path.join(tmp, "q.jsonl")
    with open(q, "w") as f:
        f.write(json.dumps({"question_id": 7, "category": "x", "turns": ["Say hi."]}) + "\n")
    saved = os.path.join(tmp, "answers.jsonl")
    rc, out, err = run("validate", "--draft", os.path.join(tmp, "vm"), "--target", MODEL, "--data", q,
                       "--max-new-tokens", "3", "--max-num-seqs", "1", "--save-responses", saved)
    assert rc == 0 and "greedy: 1 turns generated" in out, (out, err)
    ans = [json.loads(ln) for ln in open(saved)]
    assert len(ans) == 1 and ans[0]["question_id"] == 7 and len(ans[0]["choices"][0]["turns"]) == 1, ans
    # the saved answers feed count --responses
    rc, out, err = run("count", "--target", MODEL, "--data", q, "--responses", saved, "--output",
                       os.path.join(tmp, "qa.npy"))
    assert rc == 0 and "1 records answered" in out and "1 processed" in out, (out, err)


def main():
    if not os.path.exists(SPECD):
        print("skip: the specd binary is not built at", SPECD)
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        test_build(tmp)
        test_refusals(tmp)
        test_inspect_bad(tmp)
        test_with_model(tmp)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
