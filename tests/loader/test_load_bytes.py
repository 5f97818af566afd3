#!/usr/bin/env python3
"""test_load_bytes.py: the bytes one tensor-parallel rank reads when it loads a safetensors checkpoint
(engine/model/load_plan.c) == a count made here from the safetensors headers alone (struct + json,
nothing of specd), following the rules written in docs/kimi-k2.5.md "Loading at scale":

    column-parallel (q/k/v, gate/up, q_b, kv_b, every expert's gate/up packed words and scales):
        1/N of the tensor; Llama k/v with fewer KV heads than ranks: one KV head's rows
    LM head: 1/N when N divides the vocabulary, else whole; not read when tied to the embedding
    row-parallel (o_proj, every down_proj): the rank's 1/N of every row when that is at least ROW_MIN bytes
        (1024 by default; the probe is also run with 1: every row split read per row), else the whole tensor
    replicated (norms, embedding, q_a / kv_a_proj, router, weight_shape): whole
    not read: vision tower, layers at or past num_hidden_layers, tensors with no role
    expert parallel (--enable-expert-parallel): a routed expert's tensors (...mlp.experts.E.*) whole when rank r
        of N holds E (r * n_experts / N <= E < (r + 1) * n_experts / N), else not at all; the rest as above

Runs `loader_load_rank probe DIR N R THREADS` (LOAD_RANK_BIN) for every rank of the Kimi miniature
(k25 at TP 1/2, wide8 at TP 1/2/4; expert parallel: k25 at 2/4, wide8 at 2/4/8) and the tiny HF Llamas
(f32, sharded f16, bf16 tied at TP 1/2/4) and asserts the exact count. Skips (77) without the fixtures.
"""
import json
import os
import struct
import subprocess
import sys

DT = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
      "F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def headers(d):
    """name -> nbytes over every shard file, and the files' total size."""
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    out, total = {}, 0
    for f in files:
        p = os.path.join(d, f)
        total += os.path.getsize(p)
        with open(p, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        for k, v in h.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            count = 1
            for s in v["shape"]:
                count *= s
            assert e - b == count * DT[v["dtype"]], (f, k)
            out[k] = (e - b, v["shape"])
    return out, total


def layer(name):
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def row_part(nb, shape, N, row_min):
    """Bytes of a row-parallel tensor a rank reads."""
    if N > 1 and len(shape) == 2 and shape[0] > 0 and shape[1] % N == 0 and (nb // shape[0]) % N == 0 \
            and nb // shape[0] // N >= row_min:
        return nb // N
    return nb


def expected_llama(t, cfg, N, row_min=1024):
    tied, V = cfg.get("tie_word_embeddings", False), cfg["vocab_size"]
    nkv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    total = 0
    for k, (nb, shape) in t.items():
        if k == "lm_head.weight":
            total += 0 if tied else nb // N if V % N == 0 else nb
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            total += row_part(nb, shape, N, row_min)
        elif k.endswith(("k_proj.weight", "v_proj.weight")):
            total += nb // N if nkv % N == 0 else nb // nkv
        elif k.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            total += nb // N
        else:
            total += nb
    return total


COL = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight", "gate_proj.weight",
       "up_proj.weight", "gate_proj.weight_packed", "gate_proj.weight_scale", "up_proj.weight_packed",
       "up_proj.weight_scale")
ROW = ("self_attn.o_proj.weight", "down_proj.weight", "down_proj.weight_packed", "down_proj.weight_scale")
WHOLE = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight",
         "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "weight_shape", "input_layernorm.weight",
         "post_attention_layernorm.weight", "embed_tokens.weight", "norm.weight")


def expert(name):
    parts = name.split(".")
    for i, p in enumerate(parts[:-2]):
        if p == "mlp" and parts[i + 1] == "experts" and parts[i + 2].isdigit():
            return int(parts[i + 2])
    return -1


def expected_dsv3(t, cfg, N, row_min=1024, ep=False, r=0):
    tc = cfg.get("text_config", cfg)
    tied, V, L = tc.get("tie_word_embeddings", False), tc["vocab_size"], tc["num_hidden_layers"]
    per = tc["n_routed_experts"] // N
    total = 0
    for k, (nb, shape) in t.items():
        if k.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.")) or layer(k) >= L:
            continue
        if ep and expert(k) >= 0:
            total += nb if r * per <= expert(k) < (r + 1) * per else 0
        elif k.endswith("lm_head.weight"):
            total += 0 if tied else nb // N if V % N == 0 else nb
        elif k.endswith(COL):
            total += nb // N
        elif k.endswith(ROW):
            total += row_part(nb, shape, N, row_min)
        elif k.endswith(WHOLE):
            total += nb
    return total


def probe(binary, d, N, r, threads, row_min, ep=False):
    out = subprocess.run([binary, "probe", d, str(N), str(r), str(threads), str(row_min)] + (["ep"] if ep else []),
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"FAIL probe {d} TP {N} rank {r}: {out.stderr.strip()[-400:]}")
    f = out.stdout.split()
    return int(f[f.index("bytes_read") + 1]), int(f[f.index("bytes_files") + 1])


def main():
    kimi, hf, binary = os.environ.get("KIMI_C_MINI_DIR"), os.environ.get("MODEL_HF_MINI_DIR"), \
        os.environ.get("LOAD_RANK_BIN")
    cases = [(kimi, "k25", (1, 2)), (kimi, "wide8", (1, 2, 4)), (hf, "f32", (1, 2, 4)),
             (hf, "sharded", (1, 2, 4)), (hf, "bf16", (1, 2, 4))]
    if not binary or any(not root or not os.path.isfile(os.path.join(root, sub, "config.json"))
                         for root, sub, _ in cases):
        print("SKIP: fixtures (kimi_c_mini_setup, model_hf_setup) or LOAD_RANK_BIN missing")
        return 77
    fails = 0
    for root, sub, tps in cases:
        d = os.path.join(root, sub)
        cfg = json.load(open(os.path.join(d, "config.json")))
        t, total = headers(d)
        dsv3 = "text_config" in cfg or cfg.get("model_type") in ("deepseek_v3", "kimi_k2")
        for N in tps:
            for row_min in (1024, 128, 1):  # 128: exactly the Kimi k25 o_proj part at TP 2
                want = expected_dsv3(t, cfg, N, row_min) if dsv3 else expected_llama(t, cfg, N, row_min)
                for r in range(N):
                    got, files = probe(binary, d, N, r, 1 + (r % 3) * 2, row_min)
                    ok = got == want and files == total
                    fails += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {sub} TP {N} rank {r} row_min {row_min}: read {got} bytes "
                          f"(expected {want}), files {files} ({total}); {100.0 * got / total:.1f} % of the checkpoint")
    # expert parallelism: each rank its own experts whole (k25 at 2 and 4, wide8 at 2, 4 and 8)
    for root, sub, eps in ((kimi, "k25", (2, 4)), (kimi, "wide8", (2, 4, 8))):
        d = os.path.join(root, sub)
        cfg = json.load(open(os.path.join(d, "config.json")))
        t, total = headers(d)
        for N in eps:
            for row_min in (1024, 1):
                for r in range(N):
                    want = expected_dsv3(t, cfg, N, row_min, ep=True, r=r)
                    got, files = probe(binary, d, N, r, 1 + (r % 3) * 2, row_min, ep=True)
                    ok = got == want and files == total
                    fails += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {sub} EP {N} rank {r} row_min {row_min}: read {got} bytes "
                          f"(expected {want}); TP {N} would read {expected_dsv3(t, cfg, N, row_min)}")
    if fails:
        print(f"{fails} rank(s) read a different number of bytes")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
