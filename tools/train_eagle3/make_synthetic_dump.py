#!/usr/bin/env python3
"""make_synthetic_dump.py: a tiny, learnable hidden-state dump for testing the trainer.

What it owns: OUT/{dump/, target_config.json, embed.npy, vocab_map.safetensors}
describing a made-up target (hidden 64, 4 heads, 2 kv heads, vocab 512) whose
behaviour a draft can learn: token sequences follow a seeded Markov chain
(next = succ[cur] with probability 0.8, else uniform), the target's final
hidden state at t is 8 * embed[succ[ids[t]]] + noise (so its next-token
distribution peaks at succ[ids[t]]), and the aux features at t are three
fixed random projections of embed[ids[t]] + noise.  The draft vocabulary is
a seeded half of the target's (256 ids), so rows whose target argmax is
outside t2d exist and must be masked.  The first 8 tokens of each sample
are "prompt" (loss_mask 0).

Usage: make_synthetic_dump.py --out DIR [--samples 48] [--len 64] [--seed 0]
Threading: none.  Needs torch (dump writer), numpy, safetensors.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dump import DumpWriter  # noqa: E402

H, HEADS, KV, HD, INTER, VT, VD = 64, 4, 2, 16, 128, 512, 256


def make(out, samples=48, length=64, seed=0):
    rng = np.random.Generator(np.random.PCG64(seed))
    embed = (rng.standard_normal((VT, H)) / np.sqrt(H)).astype(np.float32)
    succ = rng.permutation(VT)
    proj = [(rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32) for _ in range(3)]
    used = np.sort(rng.choice(VT, VD, replace=False)).astype(np.int64)
    d2t = used - np.arange(VD, dtype=np.int64)
    t2d = np.zeros(VT, dtype=bool)
    t2d[used] = True
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "embed.npy"), embed)
    from safetensors.numpy import save_file
    save_file({"d2t": d2t, "t2d": t2d}, os.path.join(out, "vocab_map.safetensors"))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
           "intermediate_size": INTER, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "vocab_size": VT, "num_hidden_layers": 6, "max_position_embeddings": 1024,
           "tie_word_embeddings": True}
    with open(os.path.join(out, "target_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    w = DumpWriter(os.path.join(out, "dump"),
                   {"name": "synthetic", "n_layers": 6, "hidden_size": H, "vocab_size": VT},
                   [2, 3, 4], aux_dtype="bf16", samples_per_shard=16)
    for _ in range(samples):
        ids = np.empty(length, dtype=np.int64)
        ids[0] = rng.integers(VT)
        for t in range(1, length):
            ids[t] = succ[ids[t - 1]] if rng.random() < 0.8 else rng.integers(VT)
        e = embed[ids]
        aux = np.concatenate([e @ p * 4 + 0.1 * rng.standard_normal((length, H)) for p in proj], 1)
        fin = 8 * embed[succ[ids]] + 0.05 * rng.standard_normal((length, H))
        mask = np.ones(length, dtype=np.uint8)
        mask[:8] = 0
        w.add(ids, mask, aux.astype(np.float32), fin.astype(np.float32))
    w.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.out, a.samples, a.len, a.seed)
    print(f"make_synthetic_dump: wrote {a.samples} samples to {a.out}")


if __name__ == "__main__":
    main()
