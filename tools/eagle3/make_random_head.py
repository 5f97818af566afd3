#!/usr/bin/env python3
"""make_random_head.py: a random-weight EAGLE-3 head for SmolLM2-135M-Instruct.

What it owns: writing a head directory (config.json + model.safetensors) in
either checkpoint layout of REFERENCE.md section 2, deterministically from a
seed, with numpy only (no torch), so CI can regenerate the exact bytes:

  --layout speculators  config: speculators_model_type "eagle3",
                        architectures ["Eagle3Speculator"],
                        transformer_layer_config (Llama; vocab_size = target's),
                        draft_vocab_size, norm_before_residual,
                        target_hidden_size, eagle_aux_hidden_state_layer_ids,
                        speculators_config{algorithm, proposal_methods,
                        default_proposal_method, verifier{name_or_path,
                        architectures}};  tensors `layers.0.*`.
  --layout eagle        config: Llama config with architectures
                        ["LlamaForCausalLMEagle3"] + draft_vocab_size +
                        target_hidden_size + eagle_config
                        {eagle_aux_hidden_state_layer_ids: [1, 14, 26], the
                        SpecForge "output of layer i" ids of the default
                        inputs {2, 15, 27}}; tensors `midlayer.*`.
                        --minimal-config drops target_hidden_size and
                        eagle_config (defaults apply).

Tensors (bf16 unless said): fc.weight [H, 3H]; <prefix>self_attn.{q,k,v}_proj
.weight [heads*64, 2H], o_proj [H, heads*64]; mlp.{gate,up} [I, H], down [H, I];
<prefix>{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
norm.weight [H]; lm_head.weight [32000, H] (omit with --no-lm-head); d2t int64
[32000] OFFSETS; t2d bool [49152]; q/k/v/o biases [out] with --attention-bias
(HF Llama's attention_bias covers o_proj too).
No embed_tokens: the target's is shared (REFERENCE section 2).

Random vocabulary map (deterministic, non-identity): a seeded random subset of
49152 - 32000 = 17152 target ids is excluded; used = the remaining ids sorted
ascending; d2t[i] = used[i] - i; t2d[used[i]] = true.

Scales (so the draft's logits are non-degenerate): linear weights N(0, s/sqrt
(fan_in)) with s = 1 except q/k (1.5, so attention is not uniform and RoPE
matters) and lm_head (2.0, logits spread over a few units); norm weights
1 + N(0, 0.1) so a swapped norm changes the answer; biases N(0, 0.1).

The random stream: numpy Generator(PCG64(seed)); tensors are drawn in the
fixed order of TENSOR_ORDER below (stable across numpy versions for
`standard_normal` float64 and `permutation`).

Usage: make_random_head.py --layout {speculators,eagle} --out DIR --seed S
       [--rope-theta 100000|none] [--norm-before-residual]
       [--attention-bias] [--no-lm-head] [--minimal-config]
       [--corrupt no-d2t|absolute-d2t|out-of-range|not-increasing|
                  t2d-mismatch|identity-zeros]
       [--hidden H --heads N --kv-heads N --head-dim D --inter I
        --target-vocab V --draft-vocab V --target-layers L --aux-ids a,b,c
        --lm-head-scale S --verifier NAME]
--corrupt writes a head whose vocabulary map the C loader must refuse (each
mode's defect is in CORRUPTIONS; identity-zeros is the valid all-zeros
identity map, which must load).
The size options (each defaults to SmolLM2's value above, so a run without
them writes the same bytes as before they existed) size a head for another
target, e.g. the tiny Llama of tools/gen_llama_hf_mini.py (hidden 64,
vocab 512, 3 layers; see tools/eagle3/make_sampling_fixture.py). --aux-ids
are in specd's "input" convention (residual entering layer i) and are
written at the top level for the speculators layout (input convention) and
minus one in eagle_config for the eagle layout (output convention), as the
defaults are. --lm-head-scale replaces lm_head's gain 2.0; --verifier the
speculators_config verifier name.
"""

import argparse
import json
import os
import struct

import numpy as np

# SmolLM2-135M-Instruct (REFERENCE.md section 4)
H, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
TARGET_VOCAB, DRAFT_VOCAB, N_LAYERS = 49152, 32000, 30
RMS_EPS = 1e-5
AUX_IDS = [2, N_LAYERS // 2, N_LAYERS - 3]   # "input to layer i" convention
LM_HEAD_SCALE = 2.0
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def save_safetensors(path: str, tensors: dict, metadata: dict | None = None):
    """Write a safetensors file.  tensors: name -> (dtype_str, shape, bytes).
    Layout: u64 LE header length, JSON header padded with spaces to 8 bytes,
    then the data in insertion order."""
    header, off, blobs = {}, 0, []
    for name, (dt, shape, data) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape),
                        "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = metadata
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def vocab_map(rng) -> tuple[np.ndarray, np.ndarray]:
    """d2t int64 [DRAFT_VOCAB] offsets and t2d bool [TARGET_VOCAB]."""
    excluded = rng.permutation(TARGET_VOCAB)[: TARGET_VOCAB - DRAFT_VOCAB]
    t2d = np.ones(TARGET_VOCAB, dtype=bool)
    t2d[excluded] = False
    used = np.nonzero(t2d)[0].astype(np.int64)
    assert used.shape[0] == DRAFT_VOCAB
    d2t = used - np.arange(DRAFT_VOCAB, dtype=np.int64)
    return d2t, t2d


def llama_layer_config(rope_theta, attention_bias: bool) -> dict:
    c = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "vocab_size": TARGET_VOCAB,
        "max_position_embeddings": 8192,
        "attention_bias": attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if rope_theta is not None:
        c["rope_theta"] = float(rope_theta)
    return c


def make_config(layout: str, rope_theta, nbr: bool, attention_bias: bool,
                minimal: bool = False) -> dict:
    lc = llama_layer_config(rope_theta, attention_bias)
    if layout == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "transformer_layer_config": lc,
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": nbr,
            "target_hidden_size": H,
            "eagle_aux_hidden_state_layer_ids": AUX_IDS,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{
                    "proposal_type": "greedy", "speculative_tokens": 3,
                    "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": VERIFIER,
                             "architectures": ["LlamaForCausalLM"]},
            },
        }
    c = dict(lc)
    c["architectures"] = ["LlamaForCausalLMEagle3"]
    c["draft_vocab_size"] = DRAFT_VOCAB
    if nbr:
        c["norm_before_residual"] = True
    if not minimal:   # minimal: only what every SpecForge config has
        c["target_hidden_size"] = H
        # SpecForge/SGLang write explicit ids as "output of layer i" (see
        # NOTES.md): the default inputs {2, N/2, N-3} are ids {1, 14, 26}.
        c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX_IDS],
                             "use_aux_hidden_state": True}
    return c


CORRUPTIONS = {
    # name: what the loader must refuse (REFERENCE.md section 2, issue 4)
    "no-d2t": "d2t and t2d removed while draft vocab 32000 < target vocab 49152",
    "absolute-d2t": "d2t holds absolute target ids instead of offsets",
    "out-of-range": "last d2t entry maps past the target vocabulary",
    "not-increasing": "two adjacent draft ids map to the same target id",
    "t2d-mismatch": "t2d marks one target id that d2t never maps to (and misses one it does)",
    "identity-zeros": "NOT a refusal: d2t all zeros and t2d = first 32000 ids (identity map)",
}


def corrupt(t: dict, mode: str):
    """Apply one CORRUPTIONS mode to the tensors of make_tensors (in place)."""
    d2t, t2d = t["d2t"], t["t2d"]
    used = np.arange(DRAFT_VOCAB, dtype=np.int64) + d2t
    if mode == "no-d2t":
        del t["d2t"], t["t2d"]
    elif mode == "absolute-d2t":
        t["d2t"] = used.copy()
    elif mode == "out-of-range":
        d2t = d2t.copy()
        d2t[-1] = TARGET_VOCAB - (DRAFT_VOCAB - 1)       # -> target id 49152
        t["d2t"] = d2t
    elif mode == "not-increasing":
        d2t = d2t.copy()
        i = DRAFT_VOCAB // 2
        d2t[i + 1] = used[i] - (i + 1)                     # used[i+1] == used[i]
        t["d2t"] = d2t
    elif mode == "t2d-mismatch":
        t2d = t2d.copy()
        t2d[used[7]] = False
        t2d[np.nonzero(~t["t2d"])[0][0]] = True
        t["t2d"] = t2d
    elif mode == "identity-zeros":
        t["d2t"] = np.zeros(DRAFT_VOCAB, dtype=np.int64)
        t2d = np.zeros(TARGET_VOCAB, dtype=bool)
        t2d[:DRAFT_VOCAB] = True
        t["t2d"] = t2d
    else:
        raise ValueError("unknown corruption " + mode)


def make_tensors(rng, layout: str, attention_bias: bool, lm_head: bool) -> dict:
    """name -> numpy array (f32 values already rounded to bf16, or int/bool)."""
    p = "layers.0." if layout == "speculators" else "midlayer."

    def lin(out_f, in_f, s=1.0):
        w = rng.standard_normal((out_f, in_f)) * (s / np.sqrt(in_f))
        return w.astype(np.float32)

    def nw(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {}
    # TENSOR_ORDER: the random stream is consumed in exactly this order.
    d2t, t2d = vocab_map(rng)
    t["fc.weight"] = lin(H, 3 * H)
    t[p + "self_attn.q_proj.weight"] = lin(HEADS * HEAD_DIM, 2 * H, 1.5)
    t[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * HEAD_DIM, 2 * H, 1.5)
    t[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * HEAD_DIM, 2 * H)
    t[p + "self_attn.o_proj.weight"] = lin(H, HEADS * HEAD_DIM)
    t[p + "mlp.gate_proj.weight"] = lin(INTER, H)
    t[p + "mlp.up_proj.weight"] = lin(INTER, H)
    t[p + "mlp.down_proj.weight"] = lin(H, INTER)
    t[p + "input_layernorm.weight"] = nw(H)
    t[p + "hidden_norm.weight"] = nw(H)
    t[p + "post_attention_layernorm.weight"] = nw(H)
    t["norm.weight"] = nw(H)
    lm = lin(DRAFT_VOCAB, H, LM_HEAD_SCALE)  # drawn even when omitted: same stream
    if lm_head:
        t["lm_head.weight"] = lm
    if attention_bias:
        t[p + "self_attn.q_proj.bias"] = (0.1 * rng.standard_normal(HEADS * HEAD_DIM)).astype(np.float32)
        t[p + "self_attn.k_proj.bias"] = (0.1 * rng.standard_normal(KV_HEADS * HEAD_DIM)).astype(np.float32)
        t[p + "self_attn.v_proj.bias"] = (0.1 * rng.standard_normal(KV_HEADS * HEAD_DIM)).astype(np.float32)
        t[p + "self_attn.o_proj.bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
    t["d2t"] = d2t
    t["t2d"] = t2d
    return t


def write_head(out: str, layout: str, seed: int, rope_theta=100000.0,
               nbr: bool = False, attention_bias: bool = False,
               lm_head: bool = True, minimal: bool = False,
               corruption: str | None = None) -> dict:
    """Write the head; returns the config dict."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = make_tensors(rng, layout, attention_bias, lm_head)
    if corruption:
        corrupt(tensors, corruption)
    st = {}
    for name, a in tensors.items():
        if a.dtype == np.int64:
            st[name] = ("I64", a.shape, a.astype("<i8").tobytes())
        elif a.dtype == bool:
            st[name] = ("BOOL", a.shape, a.astype(np.uint8).tobytes())
        else:
            st[name] = ("BF16", a.shape, f32_to_bf16_bits(a).astype("<u2").tobytes())
    save_safetensors(os.path.join(out, "model.safetensors"), st,
                     {"format": "pt", "generator": "tools/eagle3/make_random_head.py",
                      "seed": str(seed), "layout": layout})
    cfg = make_config(layout, rope_theta, nbr, attention_bias, minimal)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return cfg


def set_sizes(hidden, heads, kv_heads, head_dim, inter, target_vocab, draft_vocab, n_layers,
              aux_ids=None, lm_head_scale=2.0, verifier=VERIFIER):
    """Overrides the module's size constants (every function reads them at
    call time). aux_ids None: the default {2, L/2, L-3}."""
    global H, HEADS, KV_HEADS, HEAD_DIM, INTER, TARGET_VOCAB, DRAFT_VOCAB, N_LAYERS, AUX_IDS
    global LM_HEAD_SCALE, VERIFIER
    if not 0 < draft_vocab <= target_vocab:
        raise SystemExit("make_random_head: need 0 < --draft-vocab <= --target-vocab")
    H, HEADS, KV_HEADS, HEAD_DIM, INTER = hidden, heads, kv_heads, head_dim, inter
    TARGET_VOCAB, DRAFT_VOCAB, N_LAYERS = target_vocab, draft_vocab, n_layers
    AUX_IDS = list(aux_ids) if aux_ids else [2, n_layers // 2, n_layers - 3]
    LM_HEAD_SCALE, VERIFIER = lm_head_scale, verifier


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=["speculators", "eagle"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rope-theta", default="100000",
                    help="a number, or 'none' to leave it out (default 10000 then applies)")
    ap.add_argument("--norm-before-residual", action="store_true")
    ap.add_argument("--attention-bias", action="store_true")
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--minimal-config", action="store_true",
                    help="eagle layout: no target_hidden_size, no eagle_config (defaults apply)")
    ap.add_argument("--corrupt", choices=sorted(CORRUPTIONS),
                    help="write a deliberately broken vocabulary map (loader refusal tests)")
    ap.add_argument("--hidden", type=int, default=H, help="draft and target hidden size")
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS)
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM)
    ap.add_argument("--inter", type=int, default=INTER, help="intermediate_size")
    ap.add_argument("--target-vocab", type=int, default=TARGET_VOCAB)
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    ap.add_argument("--target-layers", type=int, default=N_LAYERS,
                    help="target depth (sets the default aux ids {2, L/2, L-3})")
    ap.add_argument("--aux-ids", default=None,
                    help="comma-separated aux layer ids, input convention (default {2, L/2, L-3})")
    ap.add_argument("--lm-head-scale", type=float, default=LM_HEAD_SCALE)
    ap.add_argument("--verifier", default=VERIFIER, help="speculators_config verifier name_or_path")
    a = ap.parse_args()
    set_sizes(a.hidden, a.heads, a.kv_heads, a.head_dim, a.inter, a.target_vocab, a.draft_vocab,
              a.target_layers, [int(x) for x in a.aux_ids.split(",")] if a.aux_ids else None,
              a.lm_head_scale, a.verifier)
    theta = None if a.rope_theta.lower() == "none" else float(a.rope_theta)
    write_head(a.out, a.layout, a.seed, theta, a.norm_before_residual,
               a.attention_bias, not a.no_lm_head, a.minimal_config, a.corrupt)
    print(f"make_random_head: wrote {a.layout} head (seed {a.seed}) to {a.out}")


if __name__ == "__main__":
    main()
