#!/usr/bin/env python3
"""gen_capture_fixture.py: the EAGLE-3 capture point of SmolLM2, from HF transformers.

What it owns: tests/fixtures/eagle3/capture_smollm2.json, the reference for
specd's aux hidden-state capture (REFERENCE.md section 2): the residual stream
ENTERING decoder layers {2, N/2, N-3} = {2, 15, 27} of SmolLM2-135M-Instruct
(N = 30), i.e. the outputs of layers {1, 14, 26}.

Source of truth: transformers' LlamaForCausalLM loaded from the same GGUF
(`from_pretrained(dir, gguf_file=..., dtype=float32)`, which dequantises and
un-permutes q/k), `output_hidden_states=True`.  In HF, hidden_states[0] is the
embedding output and hidden_states[i] (0 < i < N) is the input of layer i;
hidden_states[N] is AFTER the final norm.  The script does not take that on
trust: forward pre-hooks on every decoder layer record its input and the
max |hook - hidden_states[i]| is written to the fixture (must be 0).  A hook on
the final norm records the post-norm hidden state too (what `specd extract`
writes as final_hidden), and the last position's top-5 next-token ids.

Fixture layout (JSON), per prompt:
  token_ids, n (positions), capture_layer_inputs [2, 15, 27] ("input to layer
  i" ids), output_of_layer_ids [1, 14, 26] (the other convention),
  hf_hidden_states_indices [2, 15, 27],
  first16: {"2": [[16 floats] x n], "15": ..., "27": ...},
  full_positions [n//2, n-1], full: {"2": [[576 floats] x 2], ...},
  final_normed_first16 [[16 floats] x n], last_top5_ids,
  hook_vs_hidden_states_max_abs_diff.

Usage: /work/venv-tools/bin/python tools/eagle3/gen_capture_fixture.py \
           --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
           --out tests/fixtures/eagle3/capture_smollm2.json
(~3 minutes on 2 cores, mostly the GGUF -> HF conversion.)
"""

import argparse
import hashlib
import json
import os

import torch

PROMPTS = [
    {"kind": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"kind": "text", "text": "The quick brown fox jumps over the lazy dog. 12345 + 678 = ?"},
]


def r(x, nd=7):
    return [float(f"{v:.{nd}g}") for v in x]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gp = os.path.realpath(a.gguf)
    d, f = os.path.dirname(gp), os.path.basename(gp)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    cap = [2, n_layers // 2, n_layers - 3]

    layer_in = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, kwargs, i=i):
            hs = args[0] if args else kwargs["hidden_states"]
            layer_in[i] = hs.detach().clone()
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    normed = {}
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, i, o: normed.__setitem__("x", o.detach().clone())))

    h = hashlib.sha256()
    with open(gp, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 20), b""):
            h.update(b)
    out = {
        "generator": "tools/eagle3/gen_capture_fixture.py",
        "command": "/work/venv-tools/bin/python tools/eagle3/gen_capture_fixture.py --gguf "
                   "models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures/eagle3/capture_smollm2.json",
        "gguf_sha256": h.hexdigest(),
        "reference": "transformers LlamaForCausalLM from the GGUF, float32, output_hidden_states=True",
        "convention": "capture_layer_inputs[i] = residual stream ENTERING decoder layer i "
                      "(= HF hidden_states[i], = output of layer i-1); default {2, N/2, N-3}",
        "n_layers": n_layers,
        "hidden_size": model.config.hidden_size,
        "prompts": [],
    }
    with torch.no_grad():
        for p in PROMPTS:
            if p["kind"] == "chat":
                ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True)
                if not isinstance(ids, list):
                    ids = ids["input_ids"]
            else:
                ids = tok(p["text"], add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids])
            o = model(input_ids=x, output_hidden_states=True)
            hs = o.hidden_states
            n = len(ids)
            diff = max(float((layer_in[i] - hs[i]).abs().max()) for i in range(n_layers))
            full_pos = [n // 2, n - 1]
            e = {
                "prompt": p,
                "token_ids": list(map(int, ids)),
                "n": n,
                "capture_layer_inputs": cap,
                "output_of_layer_ids": [c - 1 for c in cap],
                "hf_hidden_states_indices": cap,
                "hook_vs_hidden_states_max_abs_diff": diff,
                "final_norm_vs_hidden_states_last_max_abs_diff":
                    float((normed["x"] - hs[n_layers]).abs().max()),
                "first16": {str(c): [r(hs[c][0, t, :16].tolist()) for t in range(n)] for c in cap},
                "full_positions": full_pos,
                "full": {str(c): [r(hs[c][0, t].tolist()) for t in full_pos] for c in cap},
                "absmax": {str(c): float(hs[c][0].abs().max()) for c in cap},
                "final_normed_first16": [r(normed["x"][0, t, :16].tolist()) for t in range(n)],
                "last_top5_ids": torch.topk(o.logits[0, -1], 5).indices.tolist(),
            }
            out["prompts"].append(e)
            print(f"{p['kind']}: n={n} hook diff {diff} absmax {e['absmax']} top5 {e['last_top5_ids']}")
    for hk in hooks:
        hk.remove()
    with open(a.out, "w") as fo:
        json.dump(out, fo, separators=(",", ":"))
        fo.write("\n")


if __name__ == "__main__":
    main()
