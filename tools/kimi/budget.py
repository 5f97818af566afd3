#!/usr/bin/env python3
"""budget.py: memory and time budget of Kimi-K2.5 on 8xH200 at TP 8, from the real config.

What it owns
    The numbers in docs/kimi-k2.5.md between the "budget.py begin/end" markers: weight bytes
    (total and per rank, experts split by TP inside each expert or by expert parallelism), KV bytes
    per token, tokens of KV that fit, bytes read per decode step per rank at batch 1 and 32,
    collectives per decode step, and the HBM-bandwidth bound on TPOT; then the EAGLE-3 head (weights,
    draft KV per token, reads per draft step, replicated vs split across ranks, the bound per output
    token with speculation). Everything is derived from tools/kimi/kimi_k25_config.json plus the
    ASSUMPTIONS table below (printed with the results; the draft head's shape is the public
    SpecForge-style Kimi-K2 head of REFERENCE section 1).

Invariants: pure arithmetic (standard library only); deterministic output. tests/kimi checks that
the doc section equals this script's output, so the doc cannot drift from the config.

Usage: budget.py [--config FILE] [--markdown] [--check-doc docs/kimi-k2.5.md]
Threading: none.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

ASSUMPTIONS = {
    "tp": 8,
    "hbm_bytes_per_gpu": 141e9,        # H200 spec sheet: 141 GB HBM3e
    "hbm_bandwidth_Bps": 4.8e12,       # H200 spec sheet: 4.8 TB/s
    "reserve_fraction": 0.10,          # activations, CUDA graphs, NCCL/cuBLAS workspaces, fragmentation
    "bf16": 2,
    "int4_group": 32,
    "batch_sizes": (1, 32),
    "decode_context_tokens": 1536,     # mean context while decoding 1K out after 1K in
    "allreduce_latency_s": 10e-6,      # order of one small NVLink all-reduce (assumption, not measured)
    "reference_tpot_s": 9.2e-3,        # REFERENCE section 1: 8xH200 TP8, concurrency 1, 1K/1K
    # the public SpecForge-style Kimi-K2 EAGLE-3 head (REFERENCE section 1); not in the target config
    "draft": {"hidden": 7168, "heads": 64, "kv_heads": 64, "head_dim": 128, "intermediate": 18432,
              "draft_vocab": 32000, "k": 3, "acceptance_length": 3.0},
}
BEGIN, END = "<!-- budget.py begin -->", "<!-- budget.py end -->"


def load(path: str) -> dict:
    c = json.load(open(path))
    return c.get("text_config", c)


def counts(c: dict) -> dict:
    """Parameter counts by role (whole model)."""
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    nh, qr, kvr = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    kd, E, Im = c["first_k_dense_replace"], c["n_routed_experts"], c["moe_intermediate_size"]
    nmoe = L - kd
    return {
        "L": L, "n_moe": nmoe, "n_dense": kd,
        "embed": V * H, "lm_head": V * H, "final_norm": H,
        # per layer
        "q_a": qr * H, "kv_a": (kvr + dr) * H, "attn_norms": qr + kvr + 2 * H,
        "q_b": nh * (dn + dr) * qr, "kv_b": nh * (dn + dv) * kvr, "o": H * nh * dv,
        "dense_mlp": 3 * c["intermediate_size"] * H,
        "router": E * H, "router_bias": E,
        "shared": 3 * Im * c["n_shared_experts"] * H,
        "expert": 3 * Im * H,               # one routed expert (gate, up, down)
        "E": E, "k": c["num_experts_per_tok"],
    }


def int4_bytes(params: int, group: int) -> float:
    """compressed-tensors int4 group-g symmetric: 4 bits per weight + one bf16 scale per group."""
    return params * 0.5 + params / group * 2


def exact_ep_max(E: int, k: int, tp: int) -> float:
    """E[max over ranks of active experts on a rank], k of E chosen uniformly, E/tp experts per rank."""
    per = E // tp
    total = math.comb(E, k)
    e_max = 0.0
    for m in range(k):                       # E[max] = sum_{m>=0} P(max > m)
        poly = [1]                           # coefficient of x^j: ways with every rank <= m
        for _ in range(tp):
            term = [math.comb(per, c) for c in range(min(m, per) + 1)]
            new = [0] * (len(poly) + len(term) - 1)
            for i, a in enumerate(poly):
                for j, b in enumerate(term):
                    new[i + j] += a * b
            poly = new
        le = poly[k] if k < len(poly) else 0
        e_max += 1 - le / total
    return e_max


def binom_ep_max(n: int, p: float, tp: int) -> float:
    """E[max of tp iid Binomial(n, p)]: active experts per rank at larger batch (independence approx)."""
    cdf, acc = [], 0.0
    for j in range(n + 1):
        acc += math.comb(n, j) * p ** j * (1 - p) ** (n - j)
        cdf.append(min(acc, 1.0))
    return sum(1 - cdf[m] ** tp for m in range(n + 1))


def budget(c: dict, a: dict = ASSUMPTIONS) -> dict:
    n = counts(c)
    tp, bf, g = a["tp"], a["bf16"], a["int4_group"]
    L, M = n["L"], n["n_moe"]
    attn_rep = (n["q_a"] + n["kv_a"] + n["attn_norms"]) * L               # replicated on every rank
    attn_split = (n["q_b"] + n["kv_b"] + n["o"]) * L                       # heads split across ranks
    dense = n["dense_mlp"] * n["n_dense"]
    router = (n["router"]) * M
    shared = n["shared"] * M
    expert_bytes = int4_bytes(n["expert"], g)                              # one expert, int4 + scales
    experts_all = expert_bytes * n["E"] * M
    layer_norms = 0  # counted in attn_norms (input/post norms included there)
    total = {
        "embed + lm_head (bf16)": (n["embed"] + n["lm_head"] + n["final_norm"]) * bf,
        "attention, all layers (bf16)": (attn_rep + attn_split) * bf,
        "dense MLP, layer 0 (bf16)": dense * bf,
        "router gates (bf16) + biases (f32)": router * bf + n["router_bias"] * 4 * M,
        "shared experts (bf16)": shared * bf,
        "routed experts (int4 + bf16 scales)": experts_all + 2 * 4 * 3 * n["E"] * M,
    }
    per_rank = {
        "embed + lm_head (bf16)": (n["embed"] + n["lm_head"]) * bf / tp + n["final_norm"] * bf,
        "attention, all layers (bf16)": attn_rep * bf + attn_split * bf / tp,
        "dense MLP, layer 0 (bf16)": dense * bf / tp,
        "router gates (bf16) + biases (f32)": router * bf + n["router_bias"] * 4 * M,
        "shared experts (bf16)": shared * bf / tp,
        "routed experts (int4 + bf16 scales)": experts_all / tp,
    }
    assert layer_norms == 0
    kv_per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * L * bf
    weights_rank = sum(per_rank.values())
    reserve = a["reserve_fraction"] * a["hbm_bytes_per_gpu"]
    kv_budget = a["hbm_bytes_per_gpu"] - weights_rank - reserve
    # bytes read per decode step per rank
    reads = {}
    for B in a["batch_sizes"]:
        common = (per_rank["attention, all layers (bf16)"] + per_rank["dense MLP, layer 0 (bf16)"]
                  + per_rank["router gates (bf16) + biases (f32)"] + per_rank["shared experts (bf16)"]
                  + n["lm_head"] * bf / tp + B * c["hidden_size"] * bf)
        p_active = 1 - (1 - n["k"] / n["E"]) ** B                          # uniform routing
        active = n["E"] * p_active                                          # distinct experts / layer
        tp_experts = active * expert_bytes / tp * M
        if B == 1:
            ep_max = exact_ep_max(n["E"], n["k"], tp)
        else:
            ep_max = binom_ep_max(n["E"] // tp, p_active, tp)
        ep_experts = ep_max * expert_bytes * M
        kv = B * a["decode_context_tokens"] * kv_per_token
        reads[B] = {"common": common, "active_experts_per_layer": active, "tp_experts": tp_experts,
                    "ep_max_active_per_rank": ep_max, "ep_experts": ep_experts, "kv": kv,
                    "tp_total": common + tp_experts + kv, "ep_total": common + ep_experts + kv}
    n_ar = 2 * L + 1            # per layer: after o_proj, after MoE/MLP; plus the vocab-parallel embedding
    return {"n": n, "total": total, "per_rank": per_rank, "kv_per_token": kv_per_token,
            "weights_rank": weights_rank, "reserve": reserve, "kv_budget": kv_budget,
            "kv_tokens": kv_budget / kv_per_token, "kv_tokens_fp8": kv_budget / (kv_per_token / 2),
            "reads": reads, "n_allreduce": n_ar, "expert_bytes": expert_bytes}


def draft_budget(c: dict, a: dict = ASSUMPTIONS) -> dict:
    """The EAGLE-3 head at TP 8: weight bytes, draft KV bytes per token, HBM reads per draft step."""
    d, bf, tp = a["draft"], a["bf16"], a["tp"]
    H, Ht, hd = d["hidden"], c["hidden_size"], d["head_dim"]
    qd, kvd, inter, Vd = d["heads"] * hd, d["kv_heads"] * hd, d["intermediate"], d["draft_vocab"]
    p = {"fc": 3 * Ht * H, "attn": 2 * H * (qd + 2 * kvd) + qd * H, "mlp": 3 * inter * H, "norms": 4 * H,
         "lm_head": Vd * H}
    total = sum(p.values()) * bf + Vd * 8 + c["vocab_size"]          # + d2t int64, t2d bool
    kv_tok = 2 * kvd * bf                                             # one layer of K and V
    # one chained draft step at batch 1 (fc runs once per cycle, on the target's features): the layer,
    # lm_head and the draft KV of the mean decode context
    step = (p["attn"] + p["mlp"] + p["norms"] + p["lm_head"]) * bf + a["decode_context_tokens"] * kv_tok
    return {"params": p, "total": total, "split": total / tp, "step_rep": step, "step_split": step / tp,
            "fc": p["fc"] * bf, "kv_tok": kv_tok, "kv_tok_split": kv_tok / tp}


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def markdown(c: dict, a: dict = ASSUMPTIONS) -> str:
    b = budget(c, a)
    n, tp, bw = b["n"], a["tp"], a["hbm_bandwidth_Bps"]
    out = []
    w = out.append
    w(f"Computed by `tools/kimi/budget.py` from `tools/kimi/kimi_k25_config.json`. "
      f"Assumptions: TP {tp}; {a['hbm_bytes_per_gpu'] / 1e9:.0f} GB HBM and "
      f"{bw / 1e12:.1f} TB/s per H200; {a['reserve_fraction']:.0%} of HBM reserved for activations, "
      f"CUDA graphs, NCCL/cuBLAS workspaces and fragmentation; uniform expert routing; mean decode "
      f"context {a['decode_context_tokens']} tokens (1K in, 1K out); bf16 KV cache.")
    w("")
    w("| weights | whole model | per rank (TP 8) |")
    w("|---|---:|---:|")
    for k in b["total"]:
        w(f"| {k} | {gb(b['total'][k])} | {gb(b['per_rank'][k])} |")
    w(f"| **total** | **{gb(sum(b['total'].values()))}** | **{gb(b['weights_rank'])}** |")
    w("")
    w("Per rank, replicated: q_a_proj, kv_a_proj_with_mqa, all RMSNorm weights, the router gates "
      "(small, and every rank routes every token). Split: q_b_proj and kv_b_proj by heads (8 of 64 "
      "per rank), o_proj by input rows, the dense MLP and shared experts column/row-parallel, the "
      "embedding and lm_head by vocabulary. Routed experts cost "
      f"{b['expert_bytes'] / 1e6:.2f} MB each (int4 + scales) and split either way: "
      "**TP inside each expert** (every rank holds 256 of the 2048 intermediate rows of all 384 "
      "experts; gate/up column-parallel, down row-parallel, group 32 divides 256) or **expert "
      "parallel** (48 whole experts per rank). Both give the same bytes per rank; they differ in "
      "what a decode step reads (below).")
    w("")
    w(f"- KV cache per token (MLA latent, {c['kv_lora_rank']} + {c['qk_rope_head_dim']} values x "
      f"{n['L']} layers x bf16): **{b['kv_per_token']:,} bytes** ({b['kv_per_token'] / 1024:.1f} KiB); "
      "the latent is replicated on every rank (each rank serves 8 heads from the same latent).")
    w(f"- HBM left for KV per rank: {a['hbm_bytes_per_gpu'] / 1e9:.0f} - {gb(b['weights_rank'])} "
      f"weights - {gb(b['reserve'])} reserve = **{gb(b['kv_budget'])}**, i.e. "
      f"**{b['kv_tokens']:,.0f} tokens** of KV in total (replicated, so this is the capacity of the "
      f"whole 8-GPU server, not per GPU); {b['kv_tokens_fp8']:,.0f} with an fp8 latent cache.")
    w("")
    w("| bytes read per decode step, per rank | batch 1 | batch 32 |")
    w("|---|---:|---:|")
    r1, r32 = b["reads"][1], b["reads"][32]
    w(f"| attention, dense MLP, routers, shared experts, lm_head | {gb(r1['common'])} | {gb(r32['common'])} |")
    w(f"| distinct routed experts active per MoE layer | {r1['active_experts_per_layer']:.1f} | "
      f"{r32['active_experts_per_layer']:.1f} |")
    w(f"| routed experts, TP inside experts | {gb(r1['tp_experts'])} | {gb(r32['tp_experts'])} |")
    w(f"| routed experts, expert parallel (busiest rank: E[max] {r1['ep_max_active_per_rank']:.2f} / "
      f"{r32['ep_max_active_per_rank']:.2f} experts per layer) | {gb(r1['ep_experts'])} | {gb(r32['ep_experts'])} |")
    w(f"| KV latent ({a['decode_context_tokens']} tokens per sequence) | {gb(r1['kv'])} | {gb(r32['kv'])} |")
    w(f"| **total, TP inside experts** | **{gb(r1['tp_total'])}** | **{gb(r32['tp_total'])}** |")
    w(f"| **total, expert parallel** | **{gb(r1['ep_total'])}** | **{gb(r32['ep_total'])}** |")
    w(f"| HBM-bandwidth bound on TPOT (TP inside experts) | {r1['tp_total'] / bw * 1e3:.2f} ms | "
      f"{r32['tp_total'] / bw * 1e3:.2f} ms |")
    w(f"| HBM-bandwidth bound on TPOT (expert parallel) | {r1['ep_total'] / bw * 1e3:.2f} ms | "
      f"{r32['ep_total'] / bw * 1e3:.2f} ms |")
    w("")
    ar1, ar32 = c["hidden_size"] * 2, 32 * c["hidden_size"] * 2
    lat = b["n_allreduce"] * a["allreduce_latency_s"]
    w(f"Collectives per decode step: {n['L']} layers x 2 all-reduces (after o_proj; after the MLP/MoE, "
      f"where routed-expert and shared-expert partial sums are added before one all-reduce) + 1 for the "
      f"vocab-parallel embedding = **{b['n_allreduce']} all-reduces**, each of batch x {c['hidden_size']} "
      f"bf16 values: {ar1:,} bytes at batch 1, {ar32:,} bytes at batch 32; plus one gather of the "
      f"lm_head output (vocab-split logits, or a local argmax/top-k and a gather of a few values per "
      f"rank). Expert parallelism keeps the same count when tokens are already replicated after the "
      f"attention all-reduce (each rank runs its own experts on all tokens; one all-reduce combines). "
      f"At {a['allreduce_latency_s'] * 1e6:.0f} us each (an assumption for small NVLink all-reduces, "
      f"not a measurement) the collectives alone cost about {lat * 1e3:.1f} ms per step.")
    w("")
    v = budget(c, {**a, "batch_sizes": (4,)})["reads"][4]
    verify = v["common"] + v["tp_experts"] + a["decode_context_tokens"] * b["kv_per_token"]
    w(f"Against the reference serving TPOT of {a['reference_tpot_s'] * 1e3:.1f} ms (8xH200, TP8, "
      f"concurrency 1, no speculation): the bandwidth bound at batch 1 is "
      f"{r1['tp_total'] / bw * 1e3:.2f} ms, so that deployment reaches about "
      f"{r1['tp_total'] / bw / a['reference_tpot_s']:.0%} of peak HBM bandwidth; the rest is collective "
      f"latency, kernel launches and small-GEMM inefficiency at batch 1. Speculative decoding pays "
      f"off here: verifying 4 tokens of one sequence (3 drafts + 1) activates "
      f"{v['active_experts_per_layer']:.1f} distinct experts per layer instead of 8 and reads "
      f"{gb(verify)} per rank (bound {verify / bw * 1e3:.2f} ms) against {gb(r1['tp_total'])} for one "
      f"token, with the same {b['n_allreduce']} all-reduces; with an acceptance length of 3 that is "
      f"{verify / bw * 1e3 / 3:.2f} ms of HBM time per output token.")
    w("")
    d, db = a["draft"], draft_budget(c, a)
    k, tau = d["k"], d["acceptance_length"]
    rep_cycle = (k * db["step_rep"] + db["fc"]) / bw
    split_cycle = (k * db["step_split"] + db["fc"] / tp) / bw
    kv_with = b["kv_budget"] - db["total"]
    w(f"The EAGLE-3 head (the public SpecForge-style Kimi-K2 head's shape: hidden {d['hidden']}, "
      f"{d['heads']} heads / {d['kv_heads']} KV heads of {d['head_dim']}, intermediate {d['intermediate']}, "
      f"draft vocabulary {d['draft_vocab']:,}; bf16) holds **{gb(db['total'])}** of weights "
      f"(fc {gb(db['fc'])}, lm_head {gb(db['params']['lm_head'] * 2)}). Its own KV cache is one layer of "
      f"full K and V: **{db['kv_tok']:,} bytes per token**, {db['kv_tok'] / b['kv_per_token']:.0%} of the "
      f"target's latent. Replicated on every rank (no collectives inside the draft) a chained draft step "
      f"reads {gb(db['step_rep'])} with its KV ({db['step_rep'] / bw * 1e3:.2f} ms), so k = {k} drafts cost "
      f"{rep_cycle * 1e3:.2f} ms per cycle, {rep_cycle / (verify / bw):.0%} of the verify bound; and the "
      f"replicated draft KV would cut the KV capacity from {b['kv_tokens']:,.0f} to "
      f"{kv_with / (b['kv_per_token'] + db['kv_tok']):,.0f} tokens. Split like the "
      f"target (heads and MLP rows across the {tp} ranks, lm_head by draft vocabulary) it reads "
      f"{gb(db['step_split'])} per step and {split_cycle * 1e3:.2f} ms per cycle, keeps "
      f"{db['kv_tok_split']:,.0f} draft-KV bytes per token per rank "
      f"({(kv_with + db['total'] - db['split']) / (b['kv_per_token'] + db['kv_tok_split']):,.0f} tokens fit), "
      f"and adds 2 all-reduces per draft step plus a top-1 gather. With the split head, a cycle of "
      f"{k} drafts + verify is bounded by {(split_cycle + verify / bw) * 1e3:.2f} ms of HBM time for "
      f"{tau:.0f} output tokens at acceptance length {tau:.0f} "
      f"({(split_cycle + verify / bw) * 1e3 / tau:.2f} ms per token, against {r1['tp_total'] / bw * 1e3:.2f} ms "
      f"without speculation), with {b['n_allreduce'] + 2 * k} all-reduces per cycle instead of "
      f"{b['n_allreduce']} per token.")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(HERE, "kimi_k25_config.json"))
    ap.add_argument("--check-doc", help="exit 1 unless the doc's budget section equals the output")
    ap.add_argument("--write-doc", help="replace the doc's budget section with the output")
    a = ap.parse_args(argv)
    c = load(a.config)
    md = markdown(c)
    if a.check_doc or a.write_doc:
        path = a.check_doc or a.write_doc
        doc = open(path, encoding="utf-8").read()
        i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        if a.check_doc:
            if doc[i:j].strip("\n") != md.strip("\n"):
                print(f"{path}: budget section differs from tools/kimi/budget.py output")
                return 1
            print(f"{path}: budget section matches")
            return 0
        with open(path, "w", encoding="utf-8") as f:
            f.write(doc[:i] + "\n" + md + doc[j:])
        print("updated", path)
        return 0
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
