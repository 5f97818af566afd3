#!/usr/bin/env python3
"""spec_const_head.py: an EAGLE-3 head for SmolLM2 that always drafts one given target token.

What it owns: writing OUT/config.json + OUT/model.safetensors (speculators
layout), for the server tests of tests/spec/ that need a draft whose proposals
are known in advance, so that multi-token accepted blocks (and stops inside
them) happen on purpose with a real head file through the real loader and the
real draft forward.

How the head is made: the random head of tools/eagle3/make_random_head.py
(same generator, same seed semantics), with two changes:
  - norm.weight = 0, so norm(h) = 0 and every draft logit is exactly 0
    (lm_head has no bias): the draft argmax is a tie, which the proposer
    resolves to the LOWEST draft id (draft/eagle3_proposer.c, eagle3_pick:
    strict '>' scan from id 0);
  - the vocabulary map puts TOKEN at draft id 0: used = [TOKEN, TOKEN+1, ...,
    TOKEN+31999] (strictly increasing, in range when TOKEN <= 49152 - 32000),
    d2t[i] = used[i] - i (offsets), t2d[used] = true.
So every draft, at every chained step, is the target id TOKEN. Greedy
verification is then easy to predict: a block of j accepted drafts exactly when
the target's greedy continuation repeats TOKEN j times.

Requires numpy only (CI's project venv).
Usage: spec_const_head.py --out DIR --token ID [--seed 1]
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "eagle3"))
import make_random_head as mrh  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--token", type=int, required=True, help="target id every draft proposes")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if not 0 <= a.token <= mrh.TARGET_VOCAB - mrh.DRAFT_VOCAB:
        sys.exit(f"--token must be in [0, {mrh.TARGET_VOCAB - mrh.DRAFT_VOCAB}]")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(a.seed))
    t = mrh.make_tensors(rng, "speculators", False, True)
    t["norm.weight"] = np.zeros(mrh.H, dtype=np.float32)
    used = np.arange(a.token, a.token + mrh.DRAFT_VOCAB, dtype=np.int64)
    t["d2t"] = used - np.arange(mrh.DRAFT_VOCAB, dtype=np.int64)
    t2d = np.zeros(mrh.TARGET_VOCAB, dtype=bool)
    t2d[used] = True
    t["t2d"] = t2d
    st = {}
    for name, arr in t.items():
        if arr.dtype == np.int64:
            st[name] = ("I64", arr.shape, arr.astype("<i8").tobytes())
        elif arr.dtype == bool:
            st[name] = ("BOOL", arr.shape, arr.astype(np.uint8).tobytes())
        else:
            st[name] = ("BF16", arr.shape, mrh.f32_to_bf16_bits(arr).astype("<u2").tobytes())
    mrh.save_safetensors(os.path.join(a.out, "model.safetensors"), st,
                         {"format": "pt", "generator": "tools/spec_const_head.py", "seed": str(a.seed),
                          "token": str(a.token)})
    cfg = mrh.make_config("speculators", 100000.0, False, False, False)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print(f"spec_const_head: wrote a head drafting target id {a.token} to {a.out}")


if __name__ == "__main__":
    main()
