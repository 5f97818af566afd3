#!/usr/bin/env python3
"""gen_router_fixture.py: reference MoE routing from Hugging Face transformers' DeepseekV3TopkRouter
(noaux_tc: sigmoid scores, e_score_correction_bias for selection only, group limits, normalised top-k
weights times routed_scaling_factor) -> tests/fixtures/kimi_c/router_cases.json, for kimi_c_route.

Needs torch + transformers (/work/venv-tools); CI only reads the committed JSON. For each config
(Kimi-like: 1 group; DeepSeek-V3-like: 8 groups of which 4 kept; 4 groups keep 1; no normalisation)
it draws router weights, hidden states and a bias (some strongly negative, so a masked group's
expert would win if masking were by 0 instead of -inf), runs the router in float32 and stores the
router's own f32 logits (the C function's input), the bias, the chosen expert sets and weights.

Usage: /work/venv-tools/bin/python tests/kimi_c/gen_router_fixture.py
"""
import json
import os

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "kimi_c", "router_cases.json")

CONFIGS = [
    dict(name="kimi-like", n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
         routed_scaling_factor=2.827, norm_topk_prob=True),
    dict(name="deepseek-v3-like", n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
         routed_scaling_factor=2.5, norm_topk_prob=True),
    dict(name="4-groups-keep-1", n_routed_experts=32, num_experts_per_tok=3, n_group=4, topk_group=1,
         routed_scaling_factor=1.0, norm_topk_prob=True),
    dict(name="no-norm", n_routed_experts=24, num_experts_per_tok=6, n_group=3, topk_group=2,
         routed_scaling_factor=1.5, norm_topk_prob=False),
]
TOKENS, HIDDEN = 16, 32


def main() -> None:
    torch.manual_seed(0)
    out = {"source": f"transformers DeepseekV3TopkRouter (float32), tests/kimi_c/gen_router_fixture.py, "
                     f"torch {torch.__version__}", "configs": []}
    for c in CONFIGS:
        cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=c["n_routed_experts"],
                               num_experts_per_tok=c["num_experts_per_tok"], n_group=c["n_group"],
                               topk_group=c["topk_group"], routed_scaling_factor=c["routed_scaling_factor"],
                               norm_topk_prob=c["norm_topk_prob"])
        r = DeepseekV3TopkRouter(cfg).float()
        E = c["n_routed_experts"]
        with torch.no_grad():
            r.weight.copy_(torch.randn(E, HIDDEN) / HIDDEN ** 0.5)
            bias = torch.randn(E) * 0.1
            bias[torch.randperm(E)[: E // 4]] -= 2.0       # strongly negative: choice < 0
            r.e_score_correction_bias.copy_(bias)
            h = torch.randn(TOKENS, HIDDEN)
            logits, w, idx = r(h)
        out["configs"].append({
            **c, "logits": logits.tolist(), "bias": r.e_score_correction_bias.tolist(),
            "topk_ids": idx.tolist(), "topk_weights": w.tolist()})
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
