#!/usr/bin/env python3
"""gen_llama_hf_mini.py: tiny Llama-family checkpoints in Hugging Face layout
(config.json + safetensors), generated deterministically from a seed with
numpy only (CI has no torch), for the model_hf tests.

    gen_llama_hf_mini.py OUT_DIR [--expect tests/fixtures/model_hf/ref.json]
    gen_llama_hf_mini.py OUT_DIR --smollm2-shape

--smollm2-shape writes only OUT_DIR/smollm2_twin/: a seeded random Llama of
SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, head_dim
64, MLP 1536, vocabulary 49152, tied embeddings, BF16, ~270 MB), for the GPU
tests: the real GGUF cannot travel to the GPU machine, so the script
regenerates the twin there (a few seconds).

Writes OUT_DIR/<variant>/ for the variants below and OUT_DIR/bad_*/ (broken
copies of "f32" that the loader must refuse). Weights come from
numpy.random.RandomState (the legacy generator, whose stream numpy keeps
stable across versions); each variant's sha256 over its tensors (name order,
stored bytes) is printed, and with --expect compared to the digests recorded
in the reference fixture (tools/gen_llama_hf_ref.py computed the logits on
exactly those weights with transformers), so a drifting generator fails here
instead of as a logits mismatch.

The "f32" checkpoint also gets the tiny tokenizer committed in
tests/fixtures/model_hf/tokenizer/ (tokenizer.json + tokenizer_config.json,
trained by gen_llama_hf_ref.py), when present, so that `specd generate` can
run that directory end to end.

The safetensors files are written by a few lines below (8-byte header
length, JSON header padded with spaces to 8 bytes, tensors back to back):
numpy has no bfloat16, so the safetensors package cannot write BF16 from it.
BF16 is f32 rounded to nearest-even; F16 is numpy's float16.
"""
import hashlib
import json
import os
import shutil
import struct
import sys

import numpy as np

VOCAB = 512

# name -> (dtype, tied, n_layers, hidden, heads, kv_heads, head_dim or None, ffn, config extras, shards)
VARIANTS = {
    "f32": dict(dtype="F32", tied=False, layers=3, hidden=64, heads=4, kv=2, head_dim=None, ffn=176,
                extra={"rope_theta": 10000.0}, shards=1, seed=1),
    "bf16": dict(dtype="BF16", tied=True, layers=2, hidden=64, heads=4, kv=2, head_dim=24, ffn=128,
                 extra={"rope_theta": 500000.0}, shards=1, seed=2),
    "sharded": dict(dtype="F16", tied=False, layers=3, hidden=64, heads=4, kv=1, head_dim=None, ffn=96,
                    extra={"rope_theta": 10000.0, "max_position_embeddings": 256,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
                    shards=2, seed=3),
    "mistral": dict(dtype="F32", tied=True, layers=2, hidden=64, heads=8, kv=4, head_dim=None, ffn=160,
                    extra={"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None,
                           "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
                    shards=1, seed=4),
}


def to_bf16_bits(a):
    """f32 -> bf16 bits, round to nearest even (as torch's .to(bfloat16))."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def encode(a, dtype):
    if dtype == "F32":
        return np.ascontiguousarray(a, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.ascontiguousarray(a, dtype="<f2").tobytes()
    if dtype == "BF16":
        return to_bf16_bits(a).astype("<u2").tobytes()
    if dtype == "F64":
        return np.ascontiguousarray(a, dtype="<f8").tobytes()
    raise ValueError(dtype)


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype, shape, bytes), written in that order."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, data in tensors:
            f.write(data)


def make_weights(v):
    """Ordered dict name -> f32 array (PyTorch [out, in] order)."""
    rs = np.random.RandomState(v["seed"])
    H, nh, nkv, F = v["hidden"], v["heads"], v["kv"], v["ffn"]
    hd = v["head_dim"] or H // nh

    def lin(rows, cols, gain=1.0):
        return (rs.standard_normal((rows, cols)) * (gain / np.sqrt(cols))).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rs.standard_normal(n)).astype(np.float32)

    V = v.get("vocab", VOCAB)
    w = {"model.embed_tokens.weight": rs.standard_normal((V, H)).astype(np.float32)}
    for l in range(v["layers"]):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H, 2.0)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H, 2.0)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * hd)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "mlp.gate_proj.weight"] = lin(F, H)
        w[p + "mlp.up_proj.weight"] = lin(F, H)
        w[p + "mlp.down_proj.weight"] = lin(H, F)
    w["model.norm.weight"] = norm(H)
    if not v["tied"]:
        w["lm_head.weight"] = lin(V, H, 3.0)
    return w


def config_of(v):
    H, nh = v["hidden"], v["heads"]
    c = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": v.get("vocab", VOCAB), "hidden_size": H, "intermediate_size": v["ffn"],
        "num_hidden_layers": v["layers"], "num_attention_heads": nh, "num_key_value_heads": v["kv"],
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": v["tied"], "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[v["dtype"]],
    }
    if v["head_dim"]:
        c["head_dim"] = v["head_dim"]
    c.update(v["extra"])
    return c


def write_variant(out, name, v, weights=None, config=None, dtypes=None):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    w = weights if weights is not None else make_weights(v)
    digest = hashlib.sha256()
    items = []
    for n in sorted(w):
        dt = (dtypes or {}).get(n, v["dtype"])
        data = encode(w[n], dt)
        digest.update(n.encode() + b"\0" + dt.encode() + b"\0" + data)
        items.append((n, dt, w[n].shape, data))
    if v["shards"] == 1:
        write_safetensors(os.path.join(d, "model.safetensors"), items)
    else:
        k = v["shards"]
        per = (len(items) + k - 1) // k
        wmap, total = {}, 0
        for s in range(k):
            fn = f"model-{s + 1:05d}-of-{k:05d}.safetensors"
            part = items[s * per:(s + 1) * per]
            write_safetensors(os.path.join(d, fn), part)
            for n, _, _, data in part:
                wmap[n] = fn
                total += len(data)
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config if config is not None else config_of(v), f, indent=1)
    return digest.hexdigest()


def write_bad(out):
    """Broken copies of "f32", each refused by the loader with a named reason."""
    v = VARIANTS["f32"]
    base_w, base_c = make_weights(v), config_of(v)
    w = dict(base_w); del w["model.layers.1.mlp.up_proj.weight"]
    write_variant(out, "bad_missing", v, weights=w)
    w = dict(base_w); w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    write_variant(out, "bad_shape", v, weights=w)
    w = dict(base_w); w["model.norm.weight"] = np.ones((64, 1), np.float32)
    write_variant(out, "bad_norm_shape", v, weights=w)
    write_variant(out, "bad_dtype", v, dtypes={"model.layers.2.self_attn.o_proj.weight": "F64"})
    w = dict(base_w); w["model.layers.3.mlp.up_proj.weight"] = w["model.layers.2.mlp.up_proj.weight"]
    write_variant(out, "bad_extra_layer", v, weights=w)
    w = dict(base_w); del w["lm_head.weight"]
    write_variant(out, "bad_no_lm_head", v, weights=w)
    c = dict(base_c); c["vocab_size"] = 500
    write_variant(out, "bad_vocab", v, config=c)
    c = dict(base_c); c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    write_variant(out, "bad_rope", v, config=c)
    c = dict(base_c); c["num_key_value_heads"] = 3
    write_variant(out, "bad_kv_heads", v, config=c)


SMOLLM2_TWIN = dict(dtype="BF16", tied=True, layers=30, hidden=576, heads=9, kv=3, head_dim=None, ffn=1536,
                    vocab=49152, extra={"rope_theta": 100000.0, "max_position_embeddings": 8192}, shards=1, seed=135)


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    if "--smollm2-shape" in args:
        os.makedirs(args[0], exist_ok=True)
        print(f"smollm2_twin: sha256 {write_variant(args[0], 'smollm2_twin', SMOLLM2_TWIN)}")
        return 0
    out, expect = args[0], None
    if "--expect" in args:
        expect = json.load(open(args[args.index("--expect") + 1]))["sha256"]
    os.makedirs(out, exist_ok=True)
    digests = {}
    tok_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "model_hf", "tokenizer")
    for name, v in VARIANTS.items():
        digests[name] = write_variant(out, name, v)
        print(f"{name}: sha256 {digests[name]}")
        if name == "f32" and os.path.isdir(tok_dir):
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(tok_dir, f), os.path.join(out, name, f))
    write_bad(out)
    if expect is not None and expect != digests:
        sys.exit(f"FAIL: generated weights differ from the reference fixture's:\n got {digests}\n want {expect}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
