#!/usr/bin/env python3
"""test_kimi_plan.py: the bytes one rank of the REAL Kimi-K2.5 would read, tensor parallel (TP 8) and expert
parallel (EP 8, --enable-expert-parallel), from engine/model/load_plan.c itself, on a checkpoint that has
Kimi-K2.5's exact tensor list (names, dtypes, shapes: tools/kimi/kimi_k25_config.json, the layout
docs/kimi-k2.5.md describes) but no data: each shard is its safetensors header followed by a hole (a sparse
file, ~600 GB apparent, a few MB on disk). `loader_load_rank plan DIR N R ROW_MIN [ep]` (LOAD_RANK_BIN) runs
the plan on the headers (model_plan_rank_bytes: nothing past a header is read) and its count must equal
test_load_bytes.py's, made from the headers here with the rules written in docs/kimi-k2.5.md. Then:
    EP 8: a rank reads (non-expert bytes it reads at TP 8 without the experts) + (routed expert bytes) / 8;
          every rank the same count; fewer than TP 8's
    TP 8: reads the int4 down_proj of every expert whole (128-byte row parts < 1 KiB)
and prints the figures docs/kimi-k2.5.md "Expert parallelism" quotes. Skips (77) without LOAD_RANK_BIN or
when the file system has no room for the headers. Set KIMI_PLAN_KEEP=DIR to keep the checkpoint there.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_load_bytes import expected_dsv3, expert, headers  # noqa: E402  (the rules, shared)

ROOT = os.path.dirname(os.path.dirname(HERE))
CFG = os.path.join(ROOT, "tools", "kimi", "kimi_k25_config.json")
DSZ = {"BF16": 2, "F32": 4, "I32": 4}


def tensors(tc):
    """(name, dtype, shape) of Kimi-K2.5's text model, grouped by shard (one per layer, then the rest)."""
    H, L, V = tc["hidden_size"], tc["num_hidden_layers"], tc["vocab_size"]
    nh, ql, kvl = tc["num_attention_heads"], tc["q_lora_rank"], tc["kv_lora_rank"]
    n, r, v = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    I, Im, E = tc["intermediate_size"], tc["moe_intermediate_size"], tc["n_routed_experts"]
    Is = Im * tc["n_shared_experts"]
    pre = "language_model.model."
    shards = []
    for l in range(L):
        p = f"{pre}layers.{l}."
        t = [(p + "input_layernorm.weight", "BF16", [H]), (p + "post_attention_layernorm.weight", "BF16", [H]),
             (p + "self_attn.q_a_proj.weight", "BF16", [ql, H]), (p + "self_attn.q_a_layernorm.weight", "BF16", [ql]),
             (p + "self_attn.q_b_proj.weight", "BF16", [nh * (n + r), ql]),
             (p + "self_attn.kv_a_proj_with_mqa.weight", "BF16", [kvl + r, H]),
             (p + "self_attn.kv_a_layernorm.weight", "BF16", [kvl]),
             (p + "self_attn.kv_b_proj.weight", "BF16", [nh * (n + v), kvl]),
             (p + "self_attn.o_proj.weight", "BF16", [H, nh * v])]
        if l < tc["first_k_dense_replace"]:
            t += [(p + "mlp.gate_proj.weight", "BF16", [I, H]), (p + "mlp.up_proj.weight", "BF16", [I, H]),
                  (p + "mlp.down_proj.weight", "BF16", [H, I])]
        else:
            t += [(p + "mlp.gate.weight", "BF16", [E, H]), (p + "mlp.gate.e_score_correction_bias", "F32", [E]),
                  (p + "mlp.shared_experts.gate_proj.weight", "BF16", [Is, H]),
                  (p + "mlp.shared_experts.up_proj.weight", "BF16", [Is, H]),
                  (p + "mlp.shared_experts.down_proj.weight", "BF16", [H, Is])]
            for e in range(E):
                for proj, o, i in (("gate_proj", Im, H), ("up_proj", Im, H), ("down_proj", H, Im)):
                    q = f"{p}mlp.experts.{e}.{proj}."
                    t += [(q + "weight_packed", "I32", [o, i // 8]), (q + "weight_scale", "BF16", [o, i // 32]),
                          (q + "weight_shape", "I32", [2])]
        shards.append(t)
    shards.append([(pre + "embed_tokens.weight", "BF16", [V, H]), (pre + "norm.weight", "BF16", [H]),
                   ("language_model.lm_head.weight", "BF16", [V, H])])
    return shards


def write_sparse(d, shards):
    """Each shard: the 8-byte length, the JSON header (padded to 8), then a hole of the data's size."""
    weight_map, total = {}, 0
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for fn, t in zip(names, shards):
        t = sorted(t, key=lambda x: -DSZ[x[1]])  # 4-byte tensors first: every tensor aligned to its size
        h, off = {}, 0
        for name, dt, shape in t:
            nb = DSZ[dt]
            for s in shape:
                nb *= s
            h[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fn
        hb = json.dumps(h, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(d, fn), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            f.truncate(8 + len(hb) + off)
        total += off
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))


def plan(binary, d, N, r, ep):
    out = subprocess.run([binary, "plan", d, str(N), str(r), "0"] + (["ep"] if ep else []), capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"FAIL plan {'EP' if ep else 'TP'} {N} rank {r}: {out.stderr.strip()[-400:]}")
    f = out.stdout.split()
    return int(f[f.index("bytes_read") + 1]), int(f[f.index("bytes_files") + 1])


def main():
    binary = os.environ.get("LOAD_RANK_BIN")
    if not binary:
        print("SKIP: LOAD_RANK_BIN unset")
        return 77
    cfg = json.load(open(CFG))
    tc = cfg["text_config"]
    keep = os.environ.get("KIMI_PLAN_KEEP")
    d = keep or tempfile.mkdtemp(prefix="kimi_plan_")
    os.makedirs(d, exist_ok=True)
    try:
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        try:
            write_sparse(d, tensors(tc))
        except OSError as e:
            print(f"SKIP: cannot write the sparse shards in {d}: {e}")
            return 77
        t, total = headers(d)
        E, N = tc["n_routed_experts"], 8
        ex_bytes = sum(nb for k, (nb, _) in t.items() if expert(k) >= 0)
        fails = 0
        figures = {}
        for ep in (False, True):
            for r in (0, 3, 7):
                want = expected_dsv3(t, cfg, N, 1024, ep=ep, r=r)
                got, files = plan(binary, d, N, r, ep)
                ok = got == want and files == total
                fails += not ok
                figures.setdefault(ep, got)
                print(f"{'ok  ' if ok else 'FAIL'} Kimi-K2.5 {'EP' if ep else 'TP'} {N} rank {r}: reads {got} bytes "
                      f"({got / 1e9:.2f} GB; rules here: {want}) of {files} ({files / 1e9:.2f} GB) in files")
        # EP's count, by construction: TP 8's plan of everything but the routed experts, plus E/N whole experts
        rest_tp = expected_dsv3({k: v for k, v in t.items() if expert(k) < 0}, cfg, N, 1024)
        if figures[True] != rest_tp + ex_bytes // N or figures[True] >= figures[False]:
            fails += 1
            print(f"FAIL EP 8 reads {figures[True]}, want {rest_tp} + {ex_bytes} / {N}; TP 8 {figures[False]}")
        # what a rank keeps (the same at TP 8 and EP 8): 1/8 of the split tensors, the replicated ones whole
        kept = expected_dsv3(t, cfg, N, 1)
        print(f"Kimi-K2.5 per rank at {N}: keeps {kept / 1e9:.1f} GB either way; routed experts {ex_bytes / 1e9:.1f} "
              f"GB of {total / 1e9:.1f} GB ({E} per layer); TP {N} reads {figures[False] / 1e9:.1f} GB "
              f"({figures[False] / kept:.2f}x what it keeps), EP {N} reads {figures[True] / 1e9:.1f} GB "
              f"({figures[True] / kept:.2f}x): {E // N} whole experts per layer = {ex_bytes / N / 1e9:.1f} GB "
              f"+ {rest_tp / 1e9:.1f} GB of the rest")
        if fails:
            return 1
        print("OK")
        return 0
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
