#!/usr/bin/env python3
"""gen_extract_fixture.py: reference output of `specd extract` for two conversations.

What it owns: tests/fixtures/eagle3/extract_smollm2.json, produced with
hf_extract.py's logic (HF transformers from the SmolLM2 GGUF, float32) so the
C extractor can be checked against it: per conversation the exact token ids
(chat template), the loss mask (assistant content + its <|im_end|>; not the
header, not the "\\n" after), and for EVERY position the first 8 values of the
three aux features (inputs of layers 2, 15, 27) and of the post-final-norm
hidden state, plus each vector's max |value| at that position (the scale for
a relative tolerance).

Usage: /work/venv-tools/bin/python tools/train_eagle3/gen_extract_fixture.py \
           --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
           --out tests/fixtures/eagle3/extract_smollm2.json
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONVERSATIONS = [
    {"messages": [
        {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she "
                                    "sold half as many clips in May. How many clips did Natalia sell "
                                    "altogether in April and May?"},
        {"role": "assistant", "content": "In May she sold 48 / 2 = 24 clips. Altogether she sold "
                                         "48 + 24 = 72 clips."}]},
    {"messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. What do you need?"},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"}]},
]


def r(x, nd=7):
    return [float(f"{v:.{nd}g}") for v in x]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import subprocess
    from dump import DumpReader
    with tempfile.TemporaryDirectory() as td:
        inp = os.path.join(td, "convs.jsonl")
        with open(inp, "w") as f:
            for c in CONVERSATIONS:
                f.write(json.dumps(c) + "\n")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "hf_extract.py"),
                        "--gguf", a.gguf, "--input", inp, "--out", os.path.join(td, "dump"),
                        "--aux-dtype", "f32"], check=True)
        d = DumpReader(os.path.join(td, "dump"))
        man = d.manifest
        out = {
            "generator": "tools/train_eagle3/gen_extract_fixture.py (runs hf_extract.py)",
            "command": "/work/venv-tools/bin/python tools/train_eagle3/gen_extract_fixture.py --gguf "
                       "models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures/eagle3/extract_smollm2.json",
            "reference": "transformers LlamaForCausalLM from the GGUF, float32; hooks on decoder-layer inputs "
                         "and on the final norm",
            "aux_layer_ids": man["aux_layer_ids"],
            "aux_layer_convention": man["aux_layer_convention"],
            "loss_mask_rule": "1 on assistant-turn tokens: the content and its end token <|im_end|>; 0 on the "
                              "'<|im_start|>assistant\\n' header, the '\\n' after <|im_end|>, system/user turns",
            "conversations": [],
        }
        for i, c in enumerate(CONVERSATIONS):
            s = d.get(i)
            aux, fin = s["aux_hidden"], s["final_hidden"]
            H = fin.shape[1]
            out["conversations"].append({
                "messages": c["messages"],
                "input_ids": s["input_ids"].tolist(),
                "loss_mask": [int(x) for x in s["loss_mask"].tolist()],
                "aux_first8": [[r(aux[t, k * H: k * H + 8].tolist()) for k in range(3)]
                               for t in range(aux.shape[0])],
                "aux_absmax": [r([float(aux[t, k * H:(k + 1) * H].abs().max()) for k in range(3)])
                               for t in range(aux.shape[0])],
                "final_first8": [r(fin[t, :8].tolist()) for t in range(fin.shape[0])],
                "final_absmax": r([float(fin[t].abs().max()) for t in range(fin.shape[0])]),
            })
            print(f"conversation {i}: {len(s['input_ids'])} tokens, {int(s['loss_mask'].sum())} in loss")
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
