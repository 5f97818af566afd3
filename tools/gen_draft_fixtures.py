#!/usr/bin/env python3
"""gen_draft_fixtures.py: RoPE inverse frequencies of EAGLE-3 head configs, from HF transformers.

What it owns: tests/fixtures/draft/rope_inv_freq.json, the reference for
draft/eagle3_config.c's eagle3_config_inv_freq (default theta, linear and
Llama 3.1 "llama3" rope_scaling, the last as used by EAGLE-3 heads for
Llama-3.1-8B-Instruct). Each case is a Llama config fragment; the values are
transformers' own rope initialisation (ROPE_INIT_FUNCTIONS / the default
theta^(-2i/d)), computed in float64 and rounded to 9 significant digits.

Usage: /work/venv-tools/bin/python tools/gen_draft_fixtures.py \
           --out tests/fixtures/draft/rope_inv_freq.json
"""

import argparse
import json

import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

CASES = [
    ("default_theta_missing", {"hidden_size": 576, "num_attention_heads": 9}),
    ("default_theta_100000", {"hidden_size": 576, "num_attention_heads": 9, "rope_theta": 100000.0}),
    ("linear_4", {"hidden_size": 512, "num_attention_heads": 8, "rope_theta": 10000.0,
                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama3_8b", {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
                   "max_position_embeddings": 131072,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
]


def inv_freq(cfg: dict) -> list:
    c = LlamaConfig(**cfg)
    rs = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kind = rs.get("rope_type", "default") if isinstance(rs, dict) else "default"
    torch.set_default_dtype(torch.float64)
    try:
        if kind == "default":
            theta = rs.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(rs, dict) else c.rope_theta
            d = c.hidden_size // c.num_attention_heads
            f = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        else:
            f, _ = ROPE_INIT_FUNCTIONS[kind](c, "cpu")
    finally:
        torch.set_default_dtype(torch.float32)
    return [float(f"{float(x):.9g}") for x in f.to(torch.float64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"generator": "tools/gen_draft_fixtures.py", "transformers": transformers.__version__, "cases": []}
    for name, cfg in CASES:
        out["cases"].append({"name": name, "config": cfg, "inv_freq": inv_freq(cfg)})
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
