#!/usr/bin/env python3
"""Writes a "shape twin" of SmolLM2-135M-Instruct.Q4_1.gguf: a GGUF v3 llama
model with the same hyper-parameters, tensor names, shapes and block formats
(token_embd Q8_0 tied with the output, layer matrices Q4_1, norms F32) but
seeded random weights, and no tokenizer metadata.

What it is for: speed and kernel-identity checks on a machine that cannot
hold the real file (the device machine takes 64 MiB per call; the twin is
written there in seconds). Its logits mean nothing; its cost per token is the
real model's, since every kernel sees the same shapes and formats.

Block layouts (ggml-quants.h): Q8_0 = fp16 d + 32 int8; Q4_1 = fp16 d,
fp16 m + 16 bytes of nibbles (low nibbles = columns 0..15). Scales are drawn
so that weights are ~N(0, 0.02)-sized, which keeps activations finite.

Usage: make_twin_gguf.py OUT.gguf [--layers 30] [--seed 0]   (numpy only)
"""
import argparse
import struct

import numpy as np

ALIGN = 32
GGML_F32, GGML_Q4_1, GGML_Q8_0 = 0, 3, 8
T_U32, T_F32, T_STR = 4, 6, 8


def kv_str(k, v):
    kb, vb = k.encode(), v.encode()
    return struct.pack("<Q", len(kb)) + kb + struct.pack("<IQ", T_STR, len(vb)) + vb


def kv_u32(k, v):
    kb = k.encode()
    return struct.pack("<Q", len(kb)) + kb + struct.pack("<II", T_U32, v)


def kv_f32(k, v):
    kb = k.encode()
    return struct.pack("<Q", len(kb)) + kb + struct.pack("<If", T_F32, v)


def q8_0(rng, rows, cols):
    nb = rows * cols // 32
    d = rng.uniform(0.02 / 64, 0.02 / 32, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    q = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, q], axis=1).tobytes()


def q4_1(rng, rows, cols):
    nb = rows * cols // 32
    d = rng.uniform(0.004, 0.008, nb).astype(np.float16)
    m = (-7.5 * d.astype(np.float32)).astype(np.float16)
    q = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), m.view(np.uint8).reshape(nb, 2), q], axis=1).tobytes()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    H, NH, NKV, FFN, V = 576, 9, 3, 1536, 49152
    KVD = H // NH * NKV
    rng = np.random.default_rng(a.seed)
    tensors = [("token_embd.weight", GGML_Q8_0, V, H)]
    for layer in range(a.layers):
        p = f"blk.{layer}."
        tensors += [(p + "attn_norm.weight", GGML_F32, 1, H), (p + "ffn_norm.weight", GGML_F32, 1, H),
                    (p + "attn_q.weight", GGML_Q4_1, H, H), (p + "attn_k.weight", GGML_Q4_1, KVD, H),
                    (p + "attn_v.weight", GGML_Q4_1, KVD, H), (p + "attn_output.weight", GGML_Q4_1, H, H),
                    (p + "ffn_gate.weight", GGML_Q4_1, FFN, H), (p + "ffn_up.weight", GGML_Q4_1, FFN, H),
                    (p + "ffn_down.weight", GGML_Q4_1, H, FFN)]
    tensors.append(("output_norm.weight", GGML_F32, 1, H))
    kvs = [kv_str("general.architecture", "llama"), kv_str("general.name", "SmolLM2-135M shape twin (random)"),
           kv_u32("llama.block_count", a.layers), kv_u32("llama.context_length", 8192),
           kv_u32("llama.embedding_length", H), kv_u32("llama.feed_forward_length", FFN),
           kv_u32("llama.attention.head_count", NH), kv_u32("llama.attention.head_count_kv", NKV),
           kv_f32("llama.rope.freq_base", 100000.0), kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
           kv_u32("general.alignment", ALIGN)]
    blobs, infos, off = [], [], 0
    for name, typ, rows, cols in tensors:
        if typ == GGML_F32:
            data = rng.uniform(0.9, 1.1, cols).astype(np.float32).tobytes()
        elif typ == GGML_Q8_0:
            data = q8_0(rng, rows, cols)
        else:
            data = q4_1(rng, rows, cols)
        nb = name.encode()
        dims = [cols] if rows == 1 else [cols, rows]  # ne[0] = columns
        infos.append(struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims)) +
                     b"".join(struct.pack("<Q", x) for x in dims) + struct.pack("<IQ", typ, off))
        blobs.append(data)
        off += len(data)
        pad = (-off) % ALIGN
        blobs.append(b"\0" * pad)
        off += pad
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * ((-len(head)) % ALIGN)
    with open(a.out, "wb") as f:
        f.write(head)
        for b in blobs:
            f.write(b)
    print(f"wrote {a.out}: {len(tensors)} tensors, {a.layers} layers, {len(head) + off} bytes")


if __name__ == "__main__":
    main()
