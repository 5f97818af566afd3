#!/usr/bin/env python3
"""make_sampling_fixture.py: the target and the draft head of the end-to-end
lossless-sampling test (tests/spec/test_sampling_e2e.c), numpy only, so CI
regenerates them (ctest fixture spec_sampling_setup).

    make_sampling_fixture.py OUT_DIR

Writes
  OUT_DIR/target  the "f32" tiny Llama of tools/gen_llama_hf_mini.py (3
                  layers, hidden 64, 4 heads / 2 KV heads, vocab 512, seed 1)
                  with the tiny tokenizer of tests/fixtures/model_hf; its
                  weights' sha256 is checked against
                  tests/fixtures/model_hf/ref.json, so this is exactly the
                  checkpoint the model_hf tests compare with transformers.
  OUT_DIR/head    a random EAGLE-3 head for it (tools/eagle3/make_random_head.py,
                  speculators layout, seed SEED below): hidden 64, 4 heads /
                  2 KV heads of 16, intermediate 128, draft vocab 256 of the
                  target's 512 (a random d2t/t2d: half the target ids are
                  outside the draft vocabulary), aux ids {0, 1, 2} (input
                  convention: the embeddings and the residual entering layers
                  1 and 2; the default {2, L/2, L-3} does not fit 3 layers).
                  lm_head gain LM_HEAD_SCALE keeps the draft's q neither
                  one-hot nor flat.
Deterministic: same bytes on every run (numpy's legacy RandomState for the
target, PCG64 for the head).
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gen_llama_hf_mini as mini  # noqa: E402
import make_random_head as mrh  # noqa: E402

SEED = 7
LM_HEAD_SCALE = 4.0


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    v = mini.VARIANTS["f32"]
    digest = mini.write_variant(out, "target", v)
    want = json.load(open(os.path.join(ROOT, "tests", "fixtures", "model_hf", "ref.json")))["sha256"]["f32"]
    if digest != want:
        sys.exit(f"FAIL: target weights sha256 {digest} != model_hf reference {want}")
    tok = os.path.join(ROOT, "tests", "fixtures", "model_hf", "tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok, f), os.path.join(out, "target", f))
    H, heads, kv = v["hidden"], v["heads"], v["kv"]
    mrh.set_sizes(H, heads, kv, H // heads, 128, mini.VOCAB, 256, v["layers"], [0, 1, 2],
                  LM_HEAD_SCALE, "gen_llama_hf_mini.py f32")
    head = os.path.join(out, "head")
    shutil.rmtree(head, ignore_errors=True)
    mrh.write_head(head, "speculators", SEED, rope_theta=10000.0)
    print(f"make_sampling_fixture: target (sha256 {digest[:12]}) and head (seed {SEED}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
