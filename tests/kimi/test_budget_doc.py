#!/usr/bin/env python3
"""kimi_budget_doc: docs/kimi-k2.5.md's budget section is exactly tools/kimi/budget.py's output.

Also pins the headline numbers against hand arithmetic from REFERENCE section 1, so the script
cannot silently change the model it describes: 61 layers x (512 + 64) latent values x 2 bytes
= 70,272 bytes of KV per token; 384 experts x 60 MoE layers x 3 x 2048 x 7168 int4 weights with
one bf16 scale per 32 = 570.76 GB of routed experts; ~595 GB in all (REFERENCE: ~595 GB); the
EAGLE-3 head's weight bytes and draft-KV bytes per token.
"""
import os
import subprocess
import sys

ROOT = os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools", "kimi"))
import budget  # noqa: E402


def main() -> int:
    c = budget.load(os.path.join(ROOT, "tools", "kimi", "kimi_k25_config.json"))
    b = budget.budget(c)
    assert b["kv_per_token"] == 61 * 576 * 2 == 70272
    experts = 384 * 60 * 3 * 2048 * 7168
    assert abs(b["total"]["routed experts (int4 + bf16 scales)"] - (experts * 0.5 + experts / 32 * 2
                                                                   + 384 * 60 * 3 * 8)) < 1
    total = sum(b["total"].values())
    assert 590e9 < total < 600e9, total
    assert b["n_allreduce"] == 123
    # the EAGLE-3 head paragraph (SpecForge-style Kimi-K2 head, REFERENCE section 1), by hand:
    # fc 3H x H, q/k/v 2H -> 64 x 128, o 8192 -> H, SwiGLU 3 x 18432 x H, 4 norms, lm_head 32000 x H
    d = budget.draft_budget(c)
    H = 7168
    params = 3 * H * H + 3 * 2 * H * 8192 + 8192 * H + 3 * 18432 * H + 4 * H + 32000 * H
    assert d["total"] == params * 2 + 32000 * 8 + 163840, d["total"]
    assert d["kv_tok"] == 2 * 64 * 128 * 2 == 32768
    rc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "kimi", "budget.py"),
                         "--check-doc", os.path.join(ROOT, "docs", "kimi-k2.5.md")]).returncode
    assert rc == 0, "docs/kimi-k2.5.md budget section is stale: run tools/kimi/budget.py --write-doc"
    print("kimi budget: doc section matches budget.py; %.2f GB in all, %.2f GB per rank" %
          (total / 1e9, b["weights_rank"] / 1e9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
