#!/usr/bin/env python3
"""gen_llama_hf_ref.py: reference logits for the tiny HF Llama checkpoints of
tools/gen_llama_hf_mini.py, from Hugging Face transformers (LlamaForCausalLM /
MistralForCausalLM, eager attention, float32), for tests/model_hf.

    /work/venv-tools/bin/python tools/gen_llama_hf_ref.py [OUT=tests/fixtures/model_hf]

Writes OUT/ref.json (per variant: the weights' sha256 from the generator,
prompts as token ids, the positions checked, the greedy continuation and the
smallest top-1 margin seen) and OUT/logits_<variant>.bin (little-endian f32
[n_prompts, n_positions, vocab]). Needs torch + transformers (not in CI).

It also trains a 512-token byte-level BPE (HF tokenizers, SmolLM2's
pre-tokenizer: single digits then the GPT-2 ByteLevel regex; specials
<|endoftext|> <|im_start|> <|im_end|> = ids 0, 1, 2; SmolLM2's ChatML chat
template) on this repository's README and docs, and writes it to
OUT/tokenizer/{tokenizer.json,tokenizer_config.json}; the generator copies it
into the "f32" checkpoint. OUT/generate.json then holds, for a chat message
and a plain prompt, the prompt ids (transformers' apply_chat_template /
tokenizer), the 16-token greedy continuation of that checkpoint and its text
(tokenizer.decode, specials skipped): what `specd generate DIR` must print.
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


# SmolLM2-135M-Instruct's ChatML template, as recorded in the tokenizer fixtures
CHATML = json.load(open(os.path.join(HERE, "..", "tests", "fixtures", "tokenizer", "smollm2_chat.json")))["template"]
GEN_CHAT = "What does a paged KV cache hold? Answer in 12 words."
GEN_PROMPT = "The speculative decoder proposes 4 tokens, and the target"


def make_tokenizer(out, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = os.path.join(HERE, "..")
    corpus = []
    for f in ["README.md", "docs/engine.md", "docs/server.md", "docs/draft.md"]:
        p = os.path.join(root, f)
        if os.path.exists(p):
            corpus += open(p, encoding="utf-8").read().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab:
        sys.exit(f"trained tokenizer has {tok.get_vocab_size()} tokens, want {vocab}")
    d = os.path.join(out, "tokenizer")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
           "unk_token": "<|endoftext|>", "model_max_length": 512, "tokenizer_class": "GPT2Tokenizer",
           "add_prefix_space": False, "chat_template": CHATML,
           "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True}
                                    for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return d


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
    make_tokenizer(out, gen.VOCAB)
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
        # end to end: tokenizer + model of the "f32" directory, as `specd generate` runs them
        from transformers import AutoTokenizer
        d = os.path.join(tmp, "f32")
        tk = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        gen_ref = {"dir": "f32", "n_new": N_GREEDY, "cases": []}
        chat_ids = tk.apply_chat_template([{"role": "user", "content": GEN_CHAT}], add_generation_prompt=True,
                                          tokenize=True)
        if hasattr(chat_ids, "keys"):
            chat_ids = chat_ids["input_ids"]
        for kind, text, ids in [("chat", GEN_CHAT, list(chat_ids)), ("prompt", GEN_PROMPT, tk(GEN_PROMPT)["input_ids"])]:
            seq = list(ids)
            with torch.no_grad():
                for _ in range(N_GREEDY):
                    seq.append(int(torch.argmax(model(torch.tensor([seq])).logits[0, -1])))
            new = seq[len(ids):]
            gen_ref["cases"].append({"kind": kind, "text": text, "prompt_ids": list(ids), "greedy": new,
                                     "decoded": tk.decode(new, skip_special_tokens=True)})
            print(f"generate {kind}: {len(ids)} prompt tokens -> {new} {tk.decode(new, skip_special_tokens=True)!r}")
    with open(os.path.join(out, "generate.json"), "w") as f:
        json.dump(gen_ref, f, indent=1, ensure_ascii=False)
    with open(os.path.join(out, "ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
