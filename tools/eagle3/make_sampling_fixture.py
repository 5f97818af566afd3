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
  OUT_DIR/head    an EAGLE-3 head for it, speculators layout: hidden 64, 4
                  heads / 4 KV heads of 16, intermediate 128, draft vocab 256 of
                  the target's 512 through a random d2t/t2d (half the target ids
                  are outside the draft vocabulary), aux ids {0, 1, 2} (input
                  convention: the embeddings and the residual entering layers
                  1 and 2; the default {2, L/2, L-3} does not fit 3 layers).
                  Its tensors are drawn by tools/eagle3/make_random_head.py
                  (seed SEED) and then made an "echo" head, so that it agrees
                  with the target often enough to exercise acceptance (a
                  purely random head accepted 0.2% of drafts here and hid a
                  wrong residual distribution from the test):
                    q_proj = k_proj = ECHO_QK * [I, 0] and v_proj = [I, 0] on
                    the (embedding, hidden) input, o_proj = I, input_layernorm
                    = 1: each position attends mostly to itself and copies the
                    normalised embedding of its token into the residual;
                    mlp.down_proj = 0; fc = ECHO_NOISE * the random fc (noise
                    from the target's features); norm and lm_head = the
                    target's model.norm and the target's lm_head rows of the
                    draft vocabulary (d2t order).
                  The draft's logits are then roughly the target's "zero-layer"
                  prediction after the token just drafted or verified: q is
                  spread (not one-hot), overlaps the target's top-k, and puts
                  mass outside it and on ids whose p is 0.
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
import numpy as np  # noqa: E402

SEED = 7
LM_HEAD_SCALE = 4.0
ECHO_QK = 3.0      # q/k gain of the echo head: attention ~ on the current position
ECHO_NOISE = 0.3   # gain of the random fc kept in the echo head


def write_head(out: str, target_w: dict, echo: bool) -> None:
    """The head's tensors as make_random_head.write_head draws them (same
    stream, same random d2t/t2d); with ECHO, the layer is then rebuilt so the
    draft approximates the target (see the module docstring)."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(SEED))
    t = mrh.make_tensors(rng, "speculators", False, True)
    if echo:
        H = mrh.H
        p = "layers.0."
        eye = np.eye(H, dtype=np.float32)
        zero = np.zeros((H, H), np.float32)
        t[p + "self_attn.q_proj.weight"] = np.concatenate([ECHO_QK * eye, zero], axis=1)
        t[p + "self_attn.k_proj.weight"] = np.concatenate([ECHO_QK * eye, zero], axis=1)
        t[p + "self_attn.v_proj.weight"] = np.concatenate([eye, zero], axis=1)
        t[p + "self_attn.o_proj.weight"] = eye.copy()
        t[p + "input_layernorm.weight"] = np.ones(H, np.float32)
        t[p + "mlp.down_proj.weight"] = np.zeros_like(t[p + "mlp.down_proj.weight"])
        t["fc.weight"] = (ECHO_NOISE * t["fc.weight"]).astype(np.float32)
        t["norm.weight"] = target_w["model.norm.weight"].copy()
        used = np.arange(mrh.DRAFT_VOCAB) + t["d2t"]
        t["lm_head.weight"] = target_w["lm_head.weight"][used].copy()
    st = {}
    for name, a in t.items():
        if a.dtype == np.int64:
            st[name] = ("I64", a.shape, a.astype("<i8").tobytes())
        elif a.dtype == bool:
            st[name] = ("BOOL", a.shape, a.astype(np.uint8).tobytes())
        else:
            st[name] = ("BF16", a.shape, mrh.f32_to_bf16_bits(a).astype("<u2").tobytes())
    mrh.save_safetensors(os.path.join(out, "model.safetensors"), st,
                         {"format": "pt", "generator": "tools/eagle3/make_sampling_fixture.py",
                          "seed": str(SEED), "layout": "speculators", "echo": str(echo)})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(mrh.make_config("speculators", 10000.0, False, False), f, indent=2)
        f.write("\n")


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
    # MHA (kv heads = heads) so the echo head's V can carry the whole embedding
    mrh.set_sizes(H, heads, heads, H // heads, 128, mini.VOCAB, 256, v["layers"], [0, 1, 2],
                  LM_HEAD_SCALE, "gen_llama_hf_mini.py f32")
    tw = mini.make_weights(v)
    head = os.path.join(out, "head")
    shutil.rmtree(head, ignore_errors=True)
    write_head(head, tw, True)
    print(f"make_sampling_fixture: target (sha256 {digest[:12]}) and head (seed {SEED}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
