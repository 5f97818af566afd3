#!/usr/bin/env python3
"""gen_bf16_latent_fixture.py: the reference for specd's bf16 latent cache on the Kimi miniature.

What it owns
    tests/fixtures/kimi/mini_logits_bf16latent.json: what tools/kimi/numpy_forward.py (the doc's
    forward pass, checked against transformers by kimi_numpy_forward) gives when the MLA latent
    cache (c_kv after its norm, k_pe after RoPE) is rounded to bf16 before attention reads it, as
    specd's model_load_opts.latent_bf16 does; the same structure and positions as
    mini_logits.json (the transformers f32 fixture) for the fields kimi_c_logits reads: per prompt
    the logits at the same 5 positions (top-1, top-5 ids and logits, the 64 selected ids, max|logit|,
    the top-1/top-2 margin), a 32-token greedy continuation with its margins and, per step, the smallest
    gap between the k-th and (k+1)-th routing score of the last token over the MoE layers
    (`greedy_route_gaps`: where a tiny perturbation swaps an expert), prompt 0's hidden
    states; and, per stored row, how far this bf16-latent reference is from the f32 transformers
    fixture (`vs_f32`: the effect of the rounding alone, no specd code involved).

Invariants
    * numpy + make_mini.py only; seed 0; prompts, positions and selected ids taken from
      mini_logits.json so the two fixtures line up row for row.
    * Greedy continuations recompute the whole sequence each step (no cache): every latent is
      rounded from the same f32 values a cache would hold.
Threading: none. About a minute on 2 cores.

    .venv/bin/python tools/kimi/gen_bf16_latent_fixture.py [--out PATH] [--greedy N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpy_forward as nf  # noqa: E402


def row_facts(row: np.ndarray, pos: int, sel: np.ndarray) -> dict:
    order = np.argsort(-row, kind="stable")
    top5 = [int(i) for i in order[:5]]
    return {"pos": pos, "top1": top5[0], "top5_ids": top5, "top5_logits": [float(row[i]) for i in top5],
            "margin_top1_top2": float(row[order[0]] - row[order[1]]), "max_abs_logit": float(np.abs(row).max()),
            "sel_logits": [float(row[i]) for i in sel]}


def route_gap(m: nf.Mini, L: int) -> float:
    """Layer L's routing of the last token in the last forward: the gap between the k-th and the (k+1)-th
    selection score (sigmoid + correction bias). A perturbation larger than this swaps an expert."""
    return float(m.route_gaps[L])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "kimi", "mini_logits_bf16latent.json"))
    ap.add_argument("--greedy", type=int, default=32)
    a = ap.parse_args()
    fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "kimi", "mini_logits.json"), encoding="utf-8"))
    m = nf.Mini(0, latent_bf16=True)
    m.route_gaps = {}
    moe = m.moe

    def moe_gaps(h, L):
        W, k = m.W, m.c["num_experts_per_tok"]
        pfx = f"model.layers.{L}.mlp."
        s = (np.float32(1) / (np.float32(1) + np.exp(-(h[-1] @ W[pfx + "gate.weight"].T)))).astype(np.float32)
        o = np.sort(s + W[pfx + "gate.e_score_correction_bias"])[::-1]
        m.route_gaps[L] = float(o[k - 1] - o[k])
        return moe(h, L)
    m.moe = moe_gaps
    sel = np.array(fx["sel_ids"])
    out = {"source": "tools/kimi/numpy_forward.py (the doc's forward pass) with the MLA latent cache rounded to "
                     "bf16 (RNE), seed-0 miniature; tools/kimi/gen_bf16_latent_fixture.py",
           "sel_ids": fx["sel_ids"], "rope": fx["rope"], "rms_norm_eps": fx["rms_norm_eps"], "prompts": []}
    worst_vs_f32 = 0.0
    for pi, p in enumerate(fx["prompts"]):
        ids = p["ids"]
        logits, states = m.forward(ids, keep_states=True)
        rows = []
        for r in p["logits"]:
            f = row_facts(logits[r["pos"]], r["pos"], sel)
            ref_sel, ref_top = np.array(r["sel_logits"]), np.array(r["top5_logits"])
            got = logits[r["pos"]]
            e = max(np.abs(got[sel] - ref_sel).max(), np.abs(got[r["top5_ids"]] - ref_top).max()) / r["max_abs_logit"]
            f["vs_f32"] = {"max_abs_diff_rel": float(e), "top1_same": f["top1"] == r["top1"],
                           "top5_same": f["top5_ids"] == r["top5_ids"]}
            worst_vs_f32 = max(worst_vs_f32, e)
            rows.append(f)
        q = {"prompt": p.get("prompt"), "ids": ids, "logits": rows}
        if "hidden_states" in p:
            hs = p["hidden_states"]
            poss = hs["positions"]
            q["hidden_states"] = {
                "note": hs["note"], "positions": poss,
                "states": [[states[li][k].tolist() for k in poss] for li in range(len(hs["states"]))],
                "final_norm": [nf.rmsnorm(states[-1][k], m.W["model.norm.weight"], m.c["rms_norm_eps"]).tolist()
                               for k in poss]}
        cur, gen, margins, gaps = list(ids), [], [], []
        for _ in range(min(a.greedy, len(p["greedy"]))):
            lg = m.forward(cur, last_only=True)[0]
            o = np.argsort(-lg, kind="stable")
            gen.append(int(o[0]))
            margins.append(float(lg[o[0]] - lg[o[1]]))
            gaps.append(min(route_gap(m, L) for L in m.routes))
            cur.append(int(o[0]))
        q["greedy"], q["greedy_margins"], q["greedy_route_gaps"] = gen, margins, gaps
        n_same = next((i for i, (x, y) in enumerate(zip(gen, p["greedy"])) if x != y), len(gen))
        q["greedy_same_as_f32_prefix"] = n_same
        out["prompts"].append(q)
        print(f"prompt {pi}: {len(ids)} tokens; greedy equal to the f32 fixture's for {n_same} of {len(gen)} "
              f"tokens; smallest margin {min(margins):.4g}")
    out["worst_vs_f32_rel"] = worst_vs_f32
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=None, separators=(",", ":"))
        fh.write("\n")
    print(f"bf16 latent reference vs the f32 transformers fixture: worst logit diff {worst_vs_f32:.3g} of "
          f"max|logit|; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
