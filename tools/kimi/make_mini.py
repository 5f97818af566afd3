#!/usr/bin/env python3
"""make_mini.py: a deterministic miniature of Kimi-K2.5, in exactly its checkpoint format.

What it owns
    The one definition of the specd Kimi miniature: config keys, tensor names, dtypes, the
    int4 expert packing, the sharding. Everything downstream (tools/kimi/reference.py, the
    committed fixtures in tests/fixtures/kimi/, the C loader and model tests) reads what this
    script writes, so the checkpoint must be byte-identical for a given seed on every machine.

Invariants
    * numpy + the standard library only: CI regenerates the checkpoint from the seed with the
      project venv (no torch). The safetensors files are written by a small writer here (numpy
      has no bfloat16; bf16 tensors are raw uint16 words with dtype "BF16" in the header).
    * Bit-reproducible: random numbers come from numpy's PCG64 raw 64-bit stream (whose output
      numpy guarantees stable), seeded per tensor from (seed, crc32(name)), and are turned into
      values by integer operations and correctly-rounded IEEE +,-,*,/ only (no exp/log/cos whose
      SIMD versions differ by CPU). A value is a sum of three uniforms on (-1, 1): mean 0,
      variance 1 (Irwin-Hall), times a per-tensor standard deviation.
    * Scales are chosen so activations stay O(1) (std 1/sqrt(fan_in) for projections, std 1
      for the embedding, RMSNorm weights 1 + 0.05 * (sum of 3 uniforms)): attention is far from uniform and the
      logits are far from flat, so the reference has something to catch.
    * Routed experts are int4, compressed-tensors "pack-quantized", symmetric, group 32, as in
      Kimi-K2.5 (REFERENCE section 1). Packing (proved byte-identical to the compressed-tensors
      package by tools/kimi/check_pack.py):
          weight_packed int32 [out, in/8]; element k of a row lives in word k//8 at bits
          4*(k%8) .. 4*(k%8)+3  (the LOW nibble holds the FIRST element: little-endian nibble
          order), stored unsigned as q + 8 (offset binary, q in [-8, 7]; NOT two's complement).
          weight_scale bf16 [out, in/32]; weight_shape int32 [2] = [out, in].
          Dequantized value = bf16(q * scale): compressed-tensors multiplies in the scale's
          dtype (bf16), so the exact product q*scale (exact in f32) is rounded to bf16, RNE.
    * Quantization here: w ~ N-ish(0, 1/sqrt(in)); per group scale = bf16(max|w| / 7.5)
      (compressed-tensors' symmetric int4 rule: max / ((qmax - qmin) / 2)); q = clip(rint(w /
      scale), -8, 7) with round-half-even.

Threading: single-threaded script.

Usage: make_mini.py --seed S --out DIR [--text-model-type kimi_k2|deepseek_v3]
                    [--layout kimi_k25|kimi_k25_nomodel|deepseek_v3]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KIMI_DATA = os.environ.get("SPECD_KIMI_DATA",
                           os.path.join(os.path.dirname(REPO), "shared", "data", "kimi-k2"))

# ----------------------------------------------------------------------------------------
# Miniature dimensions (Kimi-K2.5's structure, tiny sizes; group size 32 kept).
# ----------------------------------------------------------------------------------------
MINI = dict(
    vocab_size=163840,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    routed_scaling_factor=2.827,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
)
GROUP = 32          # int4 group size along the input dimension
BOS, EOS, PAD, IM_END, MEDIA_PAD = 163584, 163585, 163839, 163586, 163605


def quantization_config() -> dict:
    """Kimi's compressed-tensors block (same shape as Kimi-K2-Thinking / K2.5 ship)."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": GROUP,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def text_config(model_type: str) -> dict:
    c = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": model_type,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "seq_aux": True,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "quantization_config": quantization_config(),
    }
    c.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in MINI.items()})
    return c


def top_config(model_type: str) -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PAD,
        "model_type": "kimi_k25",
        "quantization_config": quantization_config(),
        "text_config": text_config(model_type),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # A stub of the MoonViT tower's config: present so loaders see the real shape of the
        # file; no vision_tower.* tensors are written (text serving ignores the tower).
        "vision_config": {
            "model_type": "moonvit",
            "init_pos_emb_height": 64,
            "init_pos_emb_width": 64,
            "merge_kernel_size": [2, 2],
            "mm_hidden_size": 1152,
            "mm_projector_type": "patchmerger",
            "patch_size": 14,
            "text_hidden_size": MINI["hidden_size"],
            "vt_hidden_size": 1152,
            "vt_intermediate_size": 4304,
            "vt_num_attention_heads": 16,
            "vt_num_hidden_layers": 27,
        },
    }


# ----------------------------------------------------------------------------------------
# Deterministic values
# ----------------------------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def _uniforms(bitgen: np.random.PCG64, n: int) -> np.ndarray:
    """n uniforms in (-1, 1), float64, exact: (k + 0.5) / 2^23 - 1 for 24-bit k."""
    nw = (n + 1) // 2
    raw = bitgen.random_raw(nw).astype(np.uint64)
    k = np.empty(2 * nw, dtype=np.uint64)
    k[0::2] = (raw >> np.uint64(40)) & np.uint64(0xFFFFFF)
    k[1::2] = (raw >> np.uint64(8)) & np.uint64(0xFFFFFF)
    k = k[:n]
    return (k.astype(np.float64) + 0.5) / float(1 << 23) - 1.0


def values(seed: int, name: str, shape, std: float, mean: float = 0.0) -> np.ndarray:
    """float32 array: mean + std * (u1 + u2 + u3), u_i uniform on (-1, 1); deterministic."""
    n = int(np.prod(shape))
    bg = _rng(seed, name).bit_generator
    out = np.empty(n, dtype=np.float32)
    chunk = 1 << 20
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        u = _uniforms(bg, 3 * m).reshape(3, m)
        x = (u[0] + u[1]) + u[2]                   # exact in float64 (24-bit operands)
        out[s:s + m] = (x * std + mean).astype(np.float32)
    return out.reshape(shape)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16, round-to-nearest-even; returns uint16 bit patterns."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return b.astype(np.uint16)


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# ----------------------------------------------------------------------------------------
# int4 (compressed-tensors pack-quantized, symmetric, group 32)
# ----------------------------------------------------------------------------------------
def quantize_int4(w: np.ndarray, group: int = GROUP):
    """w float32 [out, in] -> (q int8 [out, in] in [-8, 7], scale bf16 bits uint16 [out, in/group])."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    amax = np.abs(g).max(axis=2)
    scale_bits = f32_to_bf16_bits((amax / np.float32(7.5)).astype(np.float32))
    s = bf16_bits_to_f32(scale_bits)
    s = np.where(s == 0, np.float32(np.finfo(np.float32).eps), s).astype(np.float32)
    q = np.clip(np.rint(g / s[:, :, None]), -8, 7).astype(np.int8)
    return q.reshape(out_f, in_f), scale_bits


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q int8 [rows, cols] (cols % 8 == 0) -> int32 [rows, cols/8]; elem k -> word k//8, bits 4*(k%8)."""
    rows, cols = q.shape
    u = (q.astype(np.int32) + 8).astype(np.uint32).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for k in range(8):
        words |= u[:, :, k] << np.uint32(4 * k)
    return words.view(np.int32)


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """Inverse of pack_int4: int32 [rows, cols/8] -> int8 [rows, cols]."""
    w = np.ascontiguousarray(packed).view(np.uint32)
    rows = w.shape[0]
    out = np.empty((rows, w.shape[1], 8), dtype=np.int8)
    for k in range(8):
        out[:, :, k] = ((w >> np.uint32(4 * k)) & np.uint32(0xF)).astype(np.int8) - 8
    return out.reshape(rows, -1)[:, :cols]


def dequant_int4(packed: np.ndarray, scale_bits: np.ndarray, shape) -> np.ndarray:
    """-> float32 [out, in] equal to compressed-tensors' bf16 result: bf16(q * scale), upcast."""
    out_f, in_f = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, in_f).astype(np.float32)
    s = np.repeat(bf16_bits_to_f32(scale_bits), GROUP, axis=1)[:, :in_f]
    return bf16_bits_to_f32(f32_to_bf16_bits(q * s))


# ----------------------------------------------------------------------------------------
# safetensors writer (numpy only)
# ----------------------------------------------------------------------------------------
_ST_DTYPE = {np.dtype(np.int32): "I32", np.dtype(np.float32): "F32"}


def write_safetensors(path: str, tensors: list) -> None:
    """tensors: list of (name, ndarray, dtype_str or None). uint16 arrays must give "BF16".

    Layout: 8-byte little-endian header length, JSON header padded with spaces to a multiple
    of 8, then the data; 4-byte dtypes first so every tensor is aligned to its element size.
    """
    items = []
    for name, arr, dt in tensors:
        arr = np.ascontiguousarray(arr)
        if dt is None:
            dt = _ST_DTYPE[arr.dtype]
        items.append((name, arr, dt))
    items.sort(key=lambda t: (-t[1].dtype.itemsize, t[0]))
    header, off = {}, 0
    for name, arr, dt in items:
        n = arr.nbytes
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, arr, _ in items:
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def read_safetensors_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def read_tensor(path: str, name: str) -> np.ndarray:
    """numpy view of one tensor (BF16 returned as uint16 bits)."""
    hdr, base = read_safetensors_header(path)
    e = hdr[name]
    dt = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32}[e["dtype"]]
    a, b = e["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + a)
        return np.frombuffer(f.read(b - a), dtype=np.dtype(dt).newbyteorder("<")).reshape(e["shape"])


# ----------------------------------------------------------------------------------------
# The checkpoint
# ----------------------------------------------------------------------------------------
def prefixes(layout: str) -> tuple[str, str]:
    """(prefix of model.* tensors, name of the lm_head tensor) for a layout."""
    if layout == "kimi_k25":
        return "language_model.model.", "language_model.lm_head.weight"
    if layout == "kimi_k25_nomodel":
        return "language_model.", "language_model.lm_head.weight"
    if layout == "deepseek_v3":
        return "model.", "lm_head.weight"
    raise ValueError(layout)


def build_tensors(seed: int, layout: str = "kimi_k25"):
    """Yield (shard_index, name, array, dtype_str) in a fixed order. 4 shards:
    0: embed + layers 0-1, 1: layers 2-3, 2: layers 4-5 + final norm, 3: lm_head.
    Values depend on (seed, canonical name) only, never on the layout."""
    c = MINI
    H, V = c["hidden_size"], c["vocab_size"]
    nh, qr, kvr = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    I, Im, E = c["intermediate_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    pre, head = prefixes(layout)

    def bf16(canon, shape, std, mean=0.0):
        return f32_to_bf16_bits(values(seed, canon, shape, std, mean))

    def norm(canon, n):
        return bf16(canon, (n,), 0.05, 1.0)

    def lin(canon, out_f, in_f):
        return bf16(canon, (out_f, in_f), 1.0 / in_f ** 0.5)

    yield 0, pre + "embed_tokens.weight", bf16("model.embed_tokens.weight", (V, H), 1.0), "BF16"
    for L in range(c["num_hidden_layers"]):
        shard = min(L // 2, 2)
        p, cp = f"{pre}layers.{L}.", f"model.layers.{L}."
        yield shard, p + "input_layernorm.weight", norm(cp + "input_layernorm.weight", H), "BF16"
        yield shard, p + "post_attention_layernorm.weight", norm(cp + "post_attention_layernorm.weight", H), "BF16"
        a = "self_attn."
        yield shard, p + a + "q_a_proj.weight", lin(cp + a + "q_a_proj.weight", qr, H), "BF16"
        yield shard, p + a + "q_a_layernorm.weight", norm(cp + a + "q_a_layernorm.weight", qr), "BF16"
        yield shard, p + a + "q_b_proj.weight", lin(cp + a + "q_b_proj.weight", nh * (dn + dr), qr), "BF16"
        yield shard, p + a + "kv_a_proj_with_mqa.weight", lin(cp + a + "kv_a_proj_with_mqa.weight", kvr + dr, H), "BF16"
        yield shard, p + a + "kv_a_layernorm.weight", norm(cp + a + "kv_a_layernorm.weight", kvr), "BF16"
        yield shard, p + a + "kv_b_proj.weight", lin(cp + a + "kv_b_proj.weight", nh * (dn + dv), kvr), "BF16"
        yield shard, p + a + "o_proj.weight", lin(cp + a + "o_proj.weight", H, nh * dv), "BF16"
        m = "mlp."
        if L < c["first_k_dense_replace"]:
            yield shard, p + m + "gate_proj.weight", lin(cp + m + "gate_proj.weight", I, H), "BF16"
            yield shard, p + m + "up_proj.weight", lin(cp + m + "up_proj.weight", I, H), "BF16"
            yield shard, p + m + "down_proj.weight", lin(cp + m + "down_proj.weight", H, I), "BF16"
            continue
        yield shard, p + m + "gate.weight", lin(cp + m + "gate.weight", E, H), "BF16"
        yield shard, p + m + "gate.e_score_correction_bias", values(
            seed, cp + m + "gate.e_score_correction_bias", (E,), 0.1), "F32"
        Is = Im * c["n_shared_experts"]
        se = m + "shared_experts."
        yield shard, p + se + "gate_proj.weight", lin(cp + se + "gate_proj.weight", Is, H), "BF16"
        yield shard, p + se + "up_proj.weight", lin(cp + se + "up_proj.weight", Is, H), "BF16"
        yield shard, p + se + "down_proj.weight", lin(cp + se + "down_proj.weight", H, Is), "BF16"
        for e in range(E):
            for proj, (of, inf) in (("gate_proj", (Im, H)), ("up_proj", (Im, H)), ("down_proj", (H, Im))):
                ename = f"{m}experts.{e}.{proj}."
                w = values(seed, cp + ename + "weight", (of, inf), 1.0 / inf ** 0.5)
                q, sbits = quantize_int4(w)
                yield shard, p + ename + "weight_packed", pack_int4(q), "I32"
                yield shard, p + ename + "weight_scale", sbits, "BF16"
                yield shard, p + ename + "weight_shape", np.array([of, inf], dtype=np.int32), "I32"
    yield 2, pre + "norm.weight", norm("model.norm.weight", H), "BF16"
    yield 3, head, lin("lm_head.weight", V, H), "BF16"


CHAT_TEMPLATE = os.path.join(HERE, "chat_template.jinja")
K25_EXTRA_SPECIALS = {   # REFERENCE section 1: K2.5 names absent from the K2-Instruct config
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163606: "<think>", 163607: "</think>",
}


def tokenizer_config() -> dict:
    """K2-Instruct's tokenizer_config.json (shared/data) made K2.5-like: the K2.5 special-token
    names added to added_tokens_decoder, and no embedded chat_template (the K2.5-style template
    ships as chat_template.jinja next to it)."""
    cfg = json.load(open(os.path.join(KIMI_DATA, "tokenizer_config.k2-instruct.json"), encoding="utf-8"))
    cfg.pop("chat_template", None)
    dec = cfg["added_tokens_decoder"]
    for i, name in K25_EXTRA_SPECIALS.items():
        dec.setdefault(str(i), {"content": name, "lstrip": False, "normalized": False,
                                "rstrip": False, "single_word": False, "special": True})
    cfg["added_tokens_decoder"] = dict(sorted(dec.items(), key=lambda kv: int(kv[0])))
    return cfg


def make(seed: int, out: str, text_model_type: str = "kimi_k2", layout: str = "kimi_k25",
         tokenizer_files: bool = True) -> dict:
    """Write the miniature into out/; returns {file: sha256} of what it wrote."""
    os.makedirs(out, exist_ok=True)
    nshards = 4
    shards = [[] for _ in range(nshards)]
    for shard, name, arr, dt in build_tensors(seed, layout):
        shards[shard].append((name, arr, dt))
    weight_map, total = {}, 0
    for i, items in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{nshards:05d}.safetensors"
        write_safetensors(os.path.join(out, fname), items)
        for name, arr, _ in items:
            weight_map[name] = fname
            total += arr.nbytes
        shards[i] = None                      # free the arrays
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _dump(os.path.join(out, "model.safetensors.index.json"), index)
    if layout == "deepseek_v3":
        cfg = text_config(text_model_type)
        cfg["model_type"] = "deepseek_v3"
    else:
        cfg = top_config(text_model_type)
    _dump(os.path.join(out, "config.json"), cfg)
    _dump(os.path.join(out, "generation_config.json"),
          {"bos_token_id": BOS, "eos_token_id": IM_END, "do_sample": False})
    if tokenizer_files:
        shutil.copyfile(os.path.join(KIMI_DATA, "tiktoken.model"), os.path.join(out, "tiktoken.model"))
        _dump(os.path.join(out, "tokenizer_config.json"), tokenizer_config())
        if os.path.exists(CHAT_TEMPLATE):
            shutil.copyfile(CHAT_TEMPLATE, os.path.join(out, "chat_template.jinja"))
    return {f: sha256_file(os.path.join(out, f)) for f in sorted(os.listdir(out))}


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 20), b""):
            h.update(blk)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text-model-type", choices=["kimi_k2", "deepseek_v3"], default="kimi_k2")
    ap.add_argument("--layout", choices=["kimi_k25", "kimi_k25_nomodel", "deepseek_v3"],
                    default="kimi_k25")
    ap.add_argument("--no-tokenizer", action="store_true", help="skip copying tokenizer files")
    a = ap.parse_args(argv)
    sums = make(a.seed, a.out, a.text_model_type, a.layout, not a.no_tokenizer)
    for f, s in sums.items():
        print(f"{s}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
