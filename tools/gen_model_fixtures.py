#!/usr/bin/env python3
"""Reference logits for SmolLM2-135M-Instruct from Hugging Face transformers
loading the same GGUF (weights dequantized to float32, computed in float32).

Writes tests/fixtures/model/smollm2_ref.json:
  prompts: [{ids, positions, top1, top5, logits_sel: {pos: {ids:[...], vals:[...]}}, max_abs, greedy64}]
The C test (tests/model/test_model_logits.c) compares specd's logits at those
positions: top-1 identical and max |diff| <= 1e-3 * max|logit| over the
selected ids (the top-64 of the reference plus 64 fixed ids), and the 64-token
greedy continuation token for token.

Run: /work/venv-tools/bin/python tools/gen_model_fixtures.py  (needs torch, transformers, gguf)
"""
import json, os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gguf = os.path.realpath(os.path.join(root, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
d, f = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model.eval()
model.generation_config.eos_token_id = None  # exactly 64 tokens, never stop early

texts = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
]
fixed_ids = list(range(0, 49152, 768))  # 64 fixed ids spread over the vocabulary
out = {"model_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
       "reference": f"transformers {__import__('transformers').__version__} AutoModelForCausalLM(gguf_file) float32",
       "prompts": []}
with torch.no_grad():
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([ids])).logits[0]
        n = len(ids)
        positions = sorted(set([0, n // 3, (2 * n) // 3, n - 1]))
        sel = {}
        for p in positions:
            row = logits[p]
            top = torch.topk(row, 64).indices.tolist()
            want = sorted(set(top + fixed_ids))
            sel[str(p)] = {"ids": want, "vals": [float(row[i]) for i in want],
                           "top1": int(torch.argmax(row)), "max_abs": float(row.abs().max())}
        gen = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                             attention_mask=torch.ones(1, n, dtype=torch.long), pad_token_id=2)
        cont = gen[0, n:].tolist()
        out["prompts"].append({"text": text, "ids": ids, "positions": positions, "sel": sel, "greedy64": cont})
        print(len(ids), positions, [sel[str(p)]["top1"] for p in positions], tok.decode(cont)[:80].replace("\n", "\\n"))
os.makedirs(os.path.join(root, "tests/fixtures/model"), exist_ok=True)
with open(os.path.join(root, "tests/fixtures/model/smollm2_ref.json"), "w") as fh:
    json.dump(out, fh)
