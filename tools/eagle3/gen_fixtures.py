#!/usr/bin/env python3
"""gen_fixtures.py: reference logits of random EAGLE-3 heads for specd's C draft.

What it owns: tests/fixtures/eagle3/{draft_inputs.safetensors,
draft_<name>.safetensors, draft_fixtures.json}.  For each head of HEADS below
(written by make_random_head.py into --heads-dir, NOT committed: CI
regenerates it bit-identically with numpy and checks the recorded sha256), it
runs tools/eagle3/reference.py (float64) on seeded synthetic target features
and token ids: a prefill-like pass over N-1 pairs plus K chained greedy draft
steps, and stores a small summary of the logits.  With --speculators-src it
also runs the `speculators` package's own Eagle3 model on the same inputs and
records the max |diff| (and that two deliberately wrong variants of the
reference, rope_theta swapped and norm_before_residual flipped, disagree with
it by far more, so the comparison can fail).

Conventions the fixture encodes (also in draft_fixtures.json):
  - pair (feats[t], ids[t+1]) at rotary position t, t = 0..N-2; prefill row t
    predicts ids[t+2];
  - chain step j = 1..K: g = previous pre-norm h (fc skipped), token = target
    id of the previous argmax (target = draft + d2t[draft]), position N-2+j;
  - the embedding (and, for a head without lm_head, the lm_head rows
    embed[draft + d2t[draft]]) is the target's token_embd from the SmolLM2
    GGUF, dequantised (Q8_0 -> f32 is exact).

Output tensors per head (P = N-1 prefill rows, K steps; f32 unless said):
  prefill_top5_ids i32 [P,5], prefill_top5_logits [P,5],
  prefill_sel_ids i32 [P,32] (the row's top 5 then 27 fixed seeded draft ids),
  prefill_sel_logits [P,32], prefill_lse [P] (logsumexp over the draft vocab),
  prefill_absmax [P] (max |logit|, the scale for the relative tolerance),
  prefill_h16 [P,16] (first 16 values of the pre-norm output h);
  the same with prefix step_ for the K chained steps;
  chain_draft_ids i32 [K+1], chain_target_ids i32 [K+1] (argmax of prefill's
  last row, then of each step; and their d2t-mapped target ids).

Usage (venv-tools: torch, transformers, gguf, safetensors):
  tools/eagle3/gen_fixtures.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out tests/fixtures/eagle3 --heads-dir /tmp/eagle3_heads \
      [--speculators-src DIR_OF_UNPACKED_WHEEL]
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_random_head as mrh  # noqa: E402
import reference as ref  # noqa: E402

N_TOKENS = 12          # -> 11 prefill rows
K_STEPS = 3
INPUT_SEED = 1234
SEL_SEED = 99

# name -> make_random_head arguments
HEADS = {
    "spec_s1": dict(layout="speculators", seed=1, rope_theta=100000.0, nbr=False,
                    attention_bias=False, lm_head=True, minimal=False),
    "eagle_s2": dict(layout="eagle", seed=2, rope_theta=None, nbr=True,
                     attention_bias=True, lm_head=False, minimal=False),
    "eagle_s3": dict(layout="eagle", seed=3, rope_theta=100000.0, nbr=False,
                     attention_bias=False, lm_head=True, minimal=True),
}


def head_cli(a: dict, out: str) -> str:
    s = f"tools/eagle3/make_random_head.py --layout {a['layout']} --out {out} --seed {a['seed']}"
    s += " --rope-theta " + ("none" if a["rope_theta"] is None else str(int(a["rope_theta"])))
    if a["nbr"]:
        s += " --norm-before-residual"
    if a["attention_bias"]:
        s += " --attention-bias"
    if not a["lm_head"]:
        s += " --no-lm-head"
    if a.get("minimal"):
        s += " --minimal-config"
    return s


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def summarise(logits: torch.Tensor, h: torch.Tensor, sel_fixed: np.ndarray) -> dict:
    L = logits.to(torch.float64)
    top = torch.topk(L, 5, dim=-1)
    top_ids = top.indices.numpy().astype(np.int32)
    sel = np.concatenate([top_ids, np.broadcast_to(sel_fixed, (L.shape[0], sel_fixed.shape[0]))], 1)
    sel_vals = torch.gather(L, 1, torch.from_numpy(sel.astype(np.int64))).numpy()
    return {
        "top5_ids": top_ids,
        "top5_logits": top.values.numpy().astype(np.float32),
        "sel_ids": sel.astype(np.int32),
        "sel_logits": sel_vals.astype(np.float32),
        "lse": torch.logsumexp(L, -1).numpy().astype(np.float32),
        "absmax": L.abs().max(-1).values.numpy().astype(np.float32),
        "h16": h[:, :16].numpy().astype(np.float32),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads-dir", required=True)
    ap.add_argument("--speculators-src", default=None)
    a = ap.parse_args()
    from safetensors.numpy import save_file

    os.makedirs(a.out, exist_ok=True)
    emb = ref.gguf_token_embd(a.gguf)

    rng = np.random.Generator(np.random.PCG64(INPUT_SEED))
    feats = rng.standard_normal((N_TOKENS, 3 * mrh.H)).astype(np.float32)
    ids = rng.integers(0, mrh.TARGET_VOCAB, N_TOKENS).astype(np.int32)
    sel_fixed = np.random.Generator(np.random.PCG64(SEL_SEED)).choice(
        mrh.DRAFT_VOCAB, 27, replace=False).astype(np.int32)
    save_file({"feats": feats, "ids": ids, "sel_fixed": sel_fixed},
              os.path.join(a.out, "draft_inputs.safetensors"))

    meta = {
        "generator": "tools/eagle3/gen_fixtures.py",
        "command": ("/work/venv-tools/bin/python tools/eagle3/gen_fixtures.py --gguf "
                    "models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures/eagle3 "
                    "--heads-dir /tmp/eagle3_heads"
                    + (" --speculators-src DIR" if a.speculators_src else "")),
        "gguf_sha256": sha256(a.gguf),
        "inputs": {
            "file": "draft_inputs.safetensors",
            "feats": f"f32 [{N_TOKENS}, {3 * mrh.H}] = concat(low, mid, high), "
                     f"numpy PCG64({INPUT_SEED}) standard_normal",
            "ids": f"i32 [{N_TOKENS}] target ids, integers(0, {mrh.TARGET_VOCAB}) after feats",
            "sel_fixed": f"i32 [27] draft ids, PCG64({SEL_SEED}).choice(32000, 27, replace=False)",
        },
        "conventions": {
            "pairs": "prefill row t (t = 0..N-2) consumes (feats[t], ids[t+1]) at rotary position t "
                     "and predicts ids[t+2]",
            "chain": "step j = 1..K: g = previous pre-norm h (fc skipped), token = target id of the "
                     "previous argmax (draft + d2t[draft]), position N-2+j; attends to all earlier "
                     "draft KV entries",
            "embedding": "target token_embd from the GGUF (Q8_0 dequantised); a head without lm_head "
                         "uses rows embed[draft + d2t[draft]] (SmolLM2 ties lm_head)",
            "tolerance": "compare logits with max|diff| <= 1e-4 * max|logit| of the row (absmax)",
        },
        "n_tokens": N_TOKENS, "prefill_rows": N_TOKENS - 1, "chain_steps": K_STEPS,
        "heads": {},
    }

    spec_model_cls = None
    for name, h in HEADS.items():
        hdir = os.path.join(a.heads_dir, name)
        mrh.write_head(hdir, h["layout"], h["seed"], h["rope_theta"], h["nbr"],
                       h["attention_bias"], h["lm_head"], h["minimal"])
        head = ref.Eagle3Head.load(hdir, emb)
        o = ref.run_chain(head, feats, ids, K_STEPS)
        pre = summarise(o["prefill_logits"], o["prefill_h"], sel_fixed)
        stp = summarise(o["step_logits"], o["step_h"], sel_fixed)
        t = {("prefill_" + k): v for k, v in pre.items()}
        t.update({("step_" + k): v for k, v in stp.items()})
        t["chain_draft_ids"] = np.asarray(o["draft_ids"], dtype=np.int32)
        t["chain_target_ids"] = np.asarray(o["target_ids"], dtype=np.int32)
        fn = f"draft_{name}.safetensors"
        save_file(t, os.path.join(a.out, fn))
        entry = {
            "file": fn,
            "make_head": head_cli(h, "DIR"),
            "model_safetensors_sha256": sha256(os.path.join(hdir, "model.safetensors")),
            "config_json_sha256": sha256(os.path.join(hdir, "config.json")),
            "config": {k: h[k] for k in h},
            "prefill_top1_draft_ids": pre["top5_ids"][:, 0].tolist(),
            "chain_draft_ids": o["draft_ids"],
            "chain_target_ids": o["target_ids"],
        }
        if a.speculators_src:
            import speculators_forward as sf
            m = sf.build_model(a.speculators_src, hdir, emb)
            sp_pre, sp_steps = sf.run_chain(m, feats, ids, o["target_ids"][:K_STEPS], 0)
            sp_pre1, _ = sf.run_chain(m, feats, ids, o["target_ids"][:K_STEPS], 1)
            scale = float(o["prefill_logits"].abs().max())
            cc = {
                "speculators_version": "0.9.0 (wheel source, eager attention, float64 weights)",
                "prefill_max_abs_diff": float((sp_pre - o["prefill_logits"]).abs().max()),
                "steps_max_abs_diff": float((sp_steps - o["step_logits"]).abs().max()),
                "prefill_max_abs_diff_positions_from_1": float((sp_pre1 - o["prefill_logits"]).abs().max()),
                "logit_scale": scale,
                "argmax_equal": bool((sp_pre.argmax(-1) == o["prefill_logits"].argmax(-1)).all()
                                     and (sp_steps.argmax(-1) == o["step_logits"].argmax(-1)).all()),
            }
            # negative controls: wrong semantics must disagree with speculators
            for label, field, val in (("rope_theta_swapped", "rope_theta",
                                       10000.0 if head.cfg.rope_theta != 10000.0 else 100000.0),
                                      ("norm_before_residual_flipped", "norm_before_residual",
                                       not head.cfg.norm_before_residual)):
                old = getattr(head.cfg, field)
                setattr(head.cfg, field, val)
                bad = ref.run_chain(head, feats, ids, K_STEPS)
                setattr(head.cfg, field, old)
                cc["control_" + label + "_max_abs_diff"] = float(
                    (sp_pre - bad["prefill_logits"]).abs().max())
            entry["crosscheck"] = cc
            print(name, json.dumps(cc))
            del m
        meta["heads"][name] = entry
        print(f"{name}: top1 {entry['prefill_top1_draft_ids']} chain {o['draft_ids']}")

    meta["refusal_heads"] = {
        m: {"make_head": f"tools/eagle3/make_random_head.py --layout speculators --out DIR "
                         f"--seed 1 --corrupt {m}", "defect": why}
        for m, why in mrh.CORRUPTIONS.items()}
    with open(os.path.join(a.out, "draft_fixtures.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
