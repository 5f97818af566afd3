#!/usr/bin/env python3
"""make_head.py: the EAGLE-3 draft head of the Kimi-K2.5 miniature, deterministic from a seed.

What it owns
    Writing a head directory (config.json + model.safetensors) for the seed-0 miniature of
    tools/kimi/make_mini.py, in the shape of the public SpecForge-style Kimi-K2 head (REFERENCE
    section 1: `LlamaForCausalLMEagle3`, rms_norm_eps 1e-6, rope_theta 1e6, vocab_size 163840,
    draft_vocab_size 32000, `eagle_config.eagle_aux_hidden_state_layer_ids`) scaled down to the
    miniature: hidden 128 (= the target's), 4 heads x 32 (4 kv heads), intermediate 320
    (Kimi's 18432/7168 ratio, rounded to a multiple of 32), one decoder layer, `midlayer.*`
    tensor names ("eagle" layout). numpy + stdlib only, so CI regenerates it.

The vocabulary map is NOT invented here: d2t/t2d come from a `specd vocab build` output
directory (d2t.npy int64 offsets, t2d.npy bool), which CI makes from GSM8K train tokenized
with the miniature's Kimi tokenizer and checks against tools/kimi/vocab_ref.py's independent
count (tests/kimi_c/make_head_fixture.py). The map is written into the head as `d2t` I64
[32000] and `t2d` BOOL [163840].

Aux ids (given explicitly; REFERENCE section 2): the miniature has 6 layers, where the default
{2, N/2, N-3} = {2, 3, 3} would capture one layer twice. The config states
`eagle_config.eagle_aux_hidden_state_layer_ids = [0, 2, 4]`, read as SpecForge/SGLang read
that key: OUTPUTS of layers 0, 2, 4, i.e. the residual stream ENTERING layers 1, 3, 5 (specd's
input convention, docs/draft.md).

Weights: values(seed, name) of make_mini.py (sums of three uniforms, variance 1, keyed by
(seed, tensor name)) times std 1/sqrt(fan_in) for linear layers, 1.5x that for q/k (attention
not uniform), 2x for lm_head (draft logits spread over a few units); norm weights 1 + 0.1 x
values. All bf16. No embed_tokens: the target's embedding is shared. Random weights: the head
proposes tokens in the draft vocabulary, it is not trained; lossless speculative decoding needs
a head, not a good one (acceptance comes from the oracle test in kimi_c_spec).

make_bad() writes heads the loader must refuse against the miniature (BAD: wrong target hidden size,
DeepSeek-V3's vocabulary, absolute d2t, no map, inconsistent t2d, an aux id past the last layer).

Usage: make_head.py --vocab-map DIR --out DIR [--seed 0] [--mini DIR (checks sizes)] [--bad DIR]
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_mini as mm  # noqa: E402

H = mm.MINI["hidden_size"]
N_LAYERS = mm.MINI["num_hidden_layers"]
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 4, 32, 320
TARGET_VOCAB, DRAFT_VOCAB = mm.MINI["vocab_size"], 32000
AUX_IDS_OUTPUT = [0, 2, 4]       # eagle_config ids: outputs of these layers (= inputs of 1, 3, 5)
RMS_EPS, ROPE_THETA = 1e-6, 1e6


def config() -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": mm.BOS,
        "eos_token_id": mm.EOS,
        "vocab_size": TARGET_VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS_OUTPUT, "use_aux_hidden_state": True},
    }


def read_map(d: str):
    d2t = np.load(os.path.join(d, "d2t.npy"))
    t2d = np.load(os.path.join(d, "t2d.npy"))
    if d2t.dtype != np.int64 or d2t.shape != (DRAFT_VOCAB,):
        raise SystemExit(f"{d}/d2t.npy: expected int64 [{DRAFT_VOCAB}], got {d2t.dtype} {d2t.shape}")
    if t2d.dtype != np.bool_ or t2d.shape != (TARGET_VOCAB,):
        raise SystemExit(f"{d}/t2d.npy: expected bool [{TARGET_VOCAB}], got {t2d.dtype} {t2d.shape}")
    used = np.arange(DRAFT_VOCAB, dtype=np.int64) + d2t
    if not (np.all(np.diff(used) > 0) and used[0] >= 0 and used[-1] < TARGET_VOCAB
            and int(t2d.sum()) == DRAFT_VOCAB and bool(t2d[used].all())):
        raise SystemExit(f"{d}: not a valid offset map (REFERENCE section 2 invariants)")
    return d2t, t2d


def tensors(seed: int, d2t: np.ndarray, t2d: np.ndarray) -> list:
    qd, kvd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    lin = {  # name: (shape [out, in], scale)
        "fc.weight": ((H, 3 * H), 1.0),
        "midlayer.self_attn.q_proj.weight": ((qd, 2 * H), 1.5),
        "midlayer.self_attn.k_proj.weight": ((kvd, 2 * H), 1.5),
        "midlayer.self_attn.v_proj.weight": ((kvd, 2 * H), 1.0),
        "midlayer.self_attn.o_proj.weight": ((H, qd), 1.0),
        "midlayer.mlp.gate_proj.weight": ((INTER, H), 1.0),
        "midlayer.mlp.up_proj.weight": ((INTER, H), 1.0),
        "midlayer.mlp.down_proj.weight": ((H, INTER), 1.0),
        "lm_head.weight": ((DRAFT_VOCAB, H), 2.0),
    }
    out = []
    for name, (shape, s) in lin.items():
        w = mm.values(seed, "eagle3." + name, shape, s / np.sqrt(shape[1]))
        out.append((name, mm.f32_to_bf16_bits(w), "BF16"))
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        w = mm.values(seed, "eagle3." + name, (H,), 0.1, 1.0)
        out.append((name, mm.f32_to_bf16_bits(w), "BF16"))
    out.append(("d2t", d2t.astype("<i8"), "I64"))
    out.append(("t2d", t2d.astype(np.uint8), "BOOL"))
    return out


def make(seed: int, vocab_map: str, out: str) -> dict:
    """Write the head into out/; returns {file: sha256}."""
    d2t, t2d = read_map(vocab_map)
    os.makedirs(out, exist_ok=True)
    mm.write_safetensors(os.path.join(out, "model.safetensors"), tensors(seed, d2t, t2d))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config(), f, indent=2, sort_keys=True)
        f.write("\n")
    return {f: mm.sha256_file(os.path.join(out, f)) for f in ("config.json", "model.safetensors")}


# Heads the real loader must refuse against the miniature (mode: (defect, a phrase of specd's refusal)).
BAD = {
    "hidden": ("built for a target of hidden size 256 (target_hidden_size 256, fc [128, 768])",
               "target_hidden_size 256 does not match the target's hidden size 128"),
    "vocab": ("built for DeepSeek-V3's vocabulary (vocab_size 129280, t2d [129280])",
              "t2d has 129280 entries, the target vocabulary has 163840"),
    "absolute-d2t": ("d2t holds absolute target ids instead of offsets", "d2t looks like absolute ids"),
    "no-map": ("d2t and t2d left out while the draft vocabulary is smaller than the target's", "has no d2t"),
    "t2d-mismatch": ("t2d marks one id d2t never maps to and misses one it does",
                     "t2d is inconsistent with d2t"),
    "aux-outside": ("eagle_config ids [0, 2, 6]: the output of layer 6 of a 6-layer target",
                    "is outside the 6-layer target"),
}


def make_bad(seed: int, vocab_map: str, root: str) -> dict:
    """Writes one head per BAD mode under root/<mode>/; returns {mode: refusal phrase}."""
    d2t, t2d = read_map(vocab_map)
    used = np.arange(DRAFT_VOCAB, dtype=np.int64) + d2t
    for mode in BAD:
        cfg, ts = config(), tensors(seed, d2t, t2d)
        byname = {n: i for i, (n, _, _) in enumerate(ts)}
        if mode == "hidden":
            cfg["target_hidden_size"] = 2 * H
            w = mm.values(seed, "eagle3.fc.weight.hidden256", (H, 6 * H), 1 / np.sqrt(6 * H))
            ts[byname["fc.weight"]] = ("fc.weight", mm.f32_to_bf16_bits(w), "BF16")
        elif mode == "vocab":
            cfg["vocab_size"] = 129280
            t = np.zeros(129280, dtype=np.uint8)
            t[used[used < 129280]] = 1
            ts[byname["t2d"]] = ("t2d", t, "BOOL")
        elif mode == "absolute-d2t":
            ts[byname["d2t"]] = ("d2t", used.astype("<i8"), "I64")
        elif mode == "no-map":
            ts = [t for t in ts if t[0] not in ("d2t", "t2d")]
        elif mode == "t2d-mismatch":
            t = t2d.astype(np.uint8).copy()
            t[used[len(used) // 2]] = 0
            t[int(np.nonzero(t2d == 0)[0][0])] = 1
            ts[byname["t2d"]] = ("t2d", t, "BOOL")
        elif mode == "aux-outside":
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 6]
        out = os.path.join(root, mode)
        os.makedirs(out, exist_ok=True)
        mm.write_safetensors(os.path.join(out, "model.safetensors"), ts)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
    return {m: v[1] for m, v in BAD.items()}


def check_target(mini: str) -> None:
    """The head's sizes against the miniature's config (hidden, vocab, layer count)."""
    cfg = json.load(open(os.path.join(mini, "config.json")))
    tc = cfg.get("text_config", cfg)
    got = (tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"])
    if got != (H, TARGET_VOCAB, N_LAYERS):
        raise SystemExit(f"{mini}: target (hidden, vocab, layers) = {got}, the head is for {(H, TARGET_VOCAB, N_LAYERS)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-map", required=True, help="`specd vocab build` output dir (d2t.npy, t2d.npy)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mini", help="the target miniature directory (sizes checked)")
    ap.add_argument("--bad", help="also write the BAD heads under this directory")
    a = ap.parse_args(argv)
    if a.mini:
        check_target(a.mini)
    for f, s in make(a.seed, a.vocab_map, a.out).items():
        print(f"{s}  {f}")
    if a.bad:
        for m, why in make_bad(a.seed, a.vocab_map, a.bad).items():
            print(f"{a.bad}/{m}: refused with '{why}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
