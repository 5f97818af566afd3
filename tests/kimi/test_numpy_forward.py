#!/usr/bin/env python3
"""kimi_numpy_forward: the forward pass docs/kimi-k2.5.md describes reproduces transformers.

tools/kimi/numpy_forward.py implements the doc's description (the spec the C model follows) in
numpy; here it runs on the seed-0 miniature (regenerated in memory, numpy only) and is compared
with tests/fixtures/kimi/mini_logits.json, which Hugging Face transformers' DeepseekV3ForCausalLM
produced from the same checkpoint: top-1 and top-5 ids identical at every stored position, logits
within 2e-3 x max|logit|, the YaRN inv_freq and softmax scale equal, hidden states and MoE routing
of prompt 0 equal, and the first GREEDY (default 8; env KIMI_NUMPY_GREEDY, 32 for all) tokens of
each greedy continuation identical: without a KV cache every step is a whole forward (~0.4 s here),
so CI checks 4 x 8 tokens; kimi_c_logits checks all 4 x 32 of the C model against the same fixture.
The absorbed (latent-only) MLA decode is checked against the naive form on the way.
"""
import json
import os
import sys

import numpy as np

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
import numpy_forward as nf  # noqa: E402


GREEDY = int(os.environ.get("KIMI_NUMPY_GREEDY", "8"))


def main() -> int:
    fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "kimi", "mini_logits.json"), encoding="utf-8"))
    m = nf.Mini(0)
    inv_ref = np.array(fx["rope"]["inv_freq"], dtype=np.float32)
    assert np.allclose(m.inv, inv_ref, rtol=2e-7, atol=0), (m.inv, inv_ref)
    assert abs(m.scale - fx["rope"]["softmax_scale"]) < 1e-12 and m.att == fx["rope"]["attention_scaling_cos_sin"]
    sel = np.array(fx["sel_ids"])
    worst = 0.0
    for pi, p in enumerate(fx["prompts"]):
        ids = p["ids"]
        logits, states = m.forward(ids, keep_states=True, absorbed_check=True)
        for r in p["logits"]:
            row = logits[r["pos"]]
            top5 = list(np.argsort(-row, kind="stable")[:5])
            assert top5[0] == r["top1"], (pi, r["pos"], top5, r["top5_ids"])
            assert top5 == r["top5_ids"], (pi, r["pos"], top5, r["top5_ids"])
            scale = r["max_abs_logit"]
            err = max(np.abs(row[sel] - np.array(r["sel_logits"])).max(),
                      np.abs(row[top5] - np.array(r["top5_logits"])).max()) / scale
            worst = max(worst, err)
            assert err <= 2e-3, (pi, r["pos"], err)
        if "hidden_states" in p:
            hs = p["hidden_states"]
            for li, per_pos in enumerate(hs["states"]):
                for q, ref in zip(hs["positions"], per_pos):
                    ref = np.array(ref)
                    e = np.abs(states[li][q] - ref).max() / max(np.abs(ref).max(), 1e-30)
                    assert e < 1e-4, ("hidden state", li, q, e)
            for L, rt in p["routing"].items():
                idx, w = m.routes[int(L)]          # routes of the last forward = this prompt
                for k, q in enumerate(rt["positions"]):
                    got = dict(zip(idx[q].tolist(), w[q].tolist()))
                    want = dict(zip(rt["topk_ids"][k], rt["topk_weights"][k]))
                    assert set(got) == set(want), ("routing", L, q, got, want)
                    assert all(abs(got[e] - want[e]) < 1e-5 for e in got), ("routing weights", L, q)
        cur, gen = list(ids), []
        for step in range(min(GREEDY, len(p["greedy"]))):
            lg = m.forward(cur, last_only=True)[0]
            t = int(np.argmax(lg))
            if t != p["greedy"][step]:
                raise AssertionError(f"prompt {pi} greedy step {step}: {t} != {p['greedy'][step]} "
                                     f"(reference margin {p['greedy_margins'][step]:.4g})")
            gen.append(t)
            cur.append(t)
        print(f"prompt {pi}: {len(ids)} tokens, logits and {len(gen)} greedy tokens match transformers")
    print(f"kimi numpy forward (the doc's spec) == transformers: worst logit error {worst:.2e} of "
          f"max|logit|; absorbed MLA vs naive {m.absorbed_err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
