#!/usr/bin/env python3
"""gen_llama_hf_ref.py: reference logits for the tiny HF Llama checkpoints of
tools/gen_llama_hf_mini.py, from Hugging Face transformers (LlamaForCausalLM /
MistralForCausalLM, eager attention, float32), for tests/model_hf.

    /work/venv-tools/bin/python tools/gen_llama_hf_ref.py [OUT=tests/fixtures/model_hf]

Writes OUT/ref.json (per variant: the weights' sha256 from the generator,
prompts as token ids, the positions checked, the greedy continuation and the
smallest top-1 margin seen) and OUT/logits_<variant>.bin (little-endian f32
[n_prompts, n_positions, vocab]). Needs torch + transformers (not in CI).
The checkpoints are loaded from the generator's files, not from its arrays:
transformers reads the same bytes the C loader reads.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_LENS = [9, 17, 33]
N_GREEDY = 16


def positions_of(n):
    return sorted({0, n // 3, (2 * n) // 3, n - 1})


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "tests", "fixtures", "model_hf")
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, HERE)
    import gen_llama_hf_mini as gen

    torch.manual_seed(0)
    rs = np.random.RandomState(1234)
    prompts = [[int(x) for x in rs.randint(3, gen.VOCAB, size=n)] for n in PROMPT_LENS]
    ref = {"generator": "tools/gen_llama_hf_mini.py", "reference": f"transformers {transformers.__version__}, "
           f"torch {torch.__version__}, float32, eager attention", "vocab": gen.VOCAB, "prompts": prompts,
           "positions": [positions_of(n) for n in PROMPT_LENS], "n_greedy": N_GREEDY, "sha256": {}, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, os.path.join(HERE, "gen_llama_hf_mini.py"), tmp], check=True,
                             capture_output=True, text=True)
        for line in res.stdout.splitlines():
            name, _, digest = line.split()
            ref["sha256"][name.rstrip(":")] = digest
        for name in gen.VARIANTS:
            d = os.path.join(tmp, name)
            model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                               output_loading_info=True)
            bad = {k: v for k, v in info.items() if v}
            if bad:
                sys.exit(f"{name}: transformers loading info not clean: {bad}")
            model.eval()
            logits_all, greedy, margin = [], [], float("inf")
            with torch.no_grad():
                for p, poss in zip(prompts, ref["positions"]):
                    lg = model(torch.tensor([p])).logits[0].float().numpy()
                    logits_all.append(lg[poss])
                    for q in poss:
                        t = np.sort(lg[q])[::-1]
                        margin = min(margin, float(t[0] - t[1]))
                    seq, cont = list(p), []
                    for _ in range(N_GREEDY):  # cache-free greedy: every step a full forward
                        l = model(torch.tensor([seq])).logits[0, -1].float().numpy()
                        t = np.sort(l)[::-1]
                        margin = min(margin, float(t[0] - t[1]))
                        nxt = int(np.argmax(l))
                        cont.append(nxt)
                        seq.append(nxt)
                    greedy.append(cont)
            arr = np.stack(logits_all).astype("<f4")
            arr.tofile(os.path.join(out, f"logits_{name}.bin"))
            ref["variants"][name] = {"class": type(model).__name__, "greedy": greedy, "min_top1_margin": margin,
                                     "max_abs_logit": float(np.abs(arr).max())}
            print(f"{name}: {type(model).__name__}, max|logit| {np.abs(arr).max():.3f}, min top-1 margin {margin:.4f}")
    with open(os.path.join(out, "ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
