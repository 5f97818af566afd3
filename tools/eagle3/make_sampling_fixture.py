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
  OUT_DIR/head    an EAGLE-3 head for it, speculators layout: hidden 64, 8
                  heads / 8 KV heads of 16, intermediate 176, draft vocab 256 of
                  the target's 512 through a random d2t/t2d (half the target ids
                  are outside the draft vocabulary), aux ids {0, 1, 2} (input
                  convention: the embeddings and the residual entering layers
                  1 and 2; the default {2, L/2, L-3} does not fit 3 layers).
                  Its tensors are drawn by tools/eagle3/make_random_head.py
                  (seed SEED; that keeps the random vocabulary map) and its
                  layer is then rebuilt from the target (copy_layer0) so that
                  it agrees with the target often enough to exercise
                  acceptance (a purely random head accepted 0.2% of drafts
                  here and hid a wrong residual distribution from the test):
                    heads 0-3 = target layer 0's attention (q/k/v on the
                    embedding half of the input, GQA groups unrolled), heads
                    4-7 "echo": q = k = ECHO_QK * I, v = 1 / input_layernorm,
                    so a position attends to itself and copies its raw token
                    embedding; o_proj = [layer 0's o_proj | I];
                    input_layernorm, post_attention_layernorm and the MLP =
                    layer 0's; fc = ECHO_NOISE * the random fc (0: the
                    residual starts from the echo); norm and lm_head = the
                    target's model.norm and its lm_head rows of the draft
                    vocabulary (d2t order).
                  The draft's pairs (f_t, x_{t+1}) sit at position t, so the
                  draft's attention sees tokens x_1.. at positions shifted by
                  one (RoPE is relative): its output approximates the target's
                  residual after layer 0 at the token just drafted or
                  verified, i.e. a one-layer version of the target. q is spread
                  (not one-hot), overlaps the target's top-k and also puts mass
                  where p is 0; ~13% of drafts are accepted in the test.
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
ECHO_QK = 3.0      # q/k gain of the echo heads: attention ~ on the current position
ECHO_NOISE = 0.0   # gain of the random fc kept (0.3 accepted 12.5% instead of 12.9%)
TARGET_HEADS, TARGET_KV_HEADS = 4, 2


def copy_layer0(t: dict, tw: dict) -> None:
    """Rebuilds the head's layer (in place) as target layer 0 plus echo heads."""
    H, hd, nh_t, nkv_t = mrh.H, mrh.HEAD_DIM, TARGET_HEADS, TARGET_KV_HEADS
    p, l0 = "layers.0.", "model.layers.0."
    w0 = tw[l0 + "input_layernorm.weight"]
    q = np.zeros((2 * nh_t * hd, 2 * H), np.float32)
    k = np.zeros_like(q)
    v = np.zeros_like(q)
    group = nh_t // nkv_t
    for h in range(nh_t):   # heads 0..3: target layer 0's attention (its GQA groups unrolled)
        r, g = slice(h * hd, (h + 1) * hd), slice((h // group) * hd, (h // group + 1) * hd)
        q[r, :H] = tw[l0 + "self_attn.q_proj.weight"][r]
        k[r, :H] = tw[l0 + "self_attn.k_proj.weight"][g]
        v[r, :H] = tw[l0 + "self_attn.v_proj.weight"][g]
    for h in range(nh_t):   # heads 4..7: echo (attend to self, copy the raw embedding)
        r, d = slice((nh_t + h) * hd, (nh_t + h + 1) * hd), slice(h * hd, (h + 1) * hd)
        q[r, d] = ECHO_QK * np.eye(hd, dtype=np.float32)
        k[r, d] = ECHO_QK * np.eye(hd, dtype=np.float32)
        v[r, d] = np.diag(1.0 / w0[d])
    t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"] = q, k, v
    t[p + "self_attn.o_proj.weight"] = np.concatenate([tw[l0 + "self_attn.o_proj.weight"], np.eye(H, dtype=np.float32)], axis=1)
    t[p + "input_layernorm.weight"] = w0.copy()
    t[p + "post_attention_layernorm.weight"] = tw[l0 + "post_attention_layernorm.weight"].copy()
    for m in ("gate_proj", "up_proj", "down_proj"):
        t[p + "mlp." + m + ".weight"] = tw[l0 + "mlp." + m + ".weight"].copy()
    t["fc.weight"] = (ECHO_NOISE * t["fc.weight"]).astype(np.float32)
    t["norm.weight"] = tw["model.norm.weight"].copy()
    used = np.arange(mrh.DRAFT_VOCAB) + t["d2t"]
    t["lm_head.weight"] = tw["lm_head.weight"][used].copy()


def write_head(out: str, target_w: dict, echo: bool) -> None:
    """The head's tensors as make_random_head.write_head draws them (same
    stream, same random d2t/t2d); with ECHO, the layer is then rebuilt by
    copy_layer0 so the draft approximates the target (module docstring)."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(SEED))
    t = mrh.make_tensors(rng, "speculators", False, True)
    if echo:
        copy_layer0(t, target_w)
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
    # 8 heads of 16 (MHA): 4 copy target layer 0's, 4 echo; the target's FFN width
    mrh.set_sizes(H, 2 * heads, 2 * heads, H // heads, v["ffn"], mini.VOCAB, 256, v["layers"], [0, 1, 2],
                  LM_HEAD_SCALE, "gen_llama_hf_mini.py f32")
    tw = mini.make_weights(v)
    head = os.path.join(out, "head")
    shutil.rmtree(head, ignore_errors=True)
    write_head(head, tw, True)
    print(f"make_sampling_fixture: target (sha256 {digest[:12]}) and head (seed {SEED}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
