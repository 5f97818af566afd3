#!/usr/bin/env python3
"""Independent assistant-token count for `specd vocab count` (fixture generator).

Run with the tools venv (needs gguf, tokenizers, jinja2, numpy):
    /work/venv-tools/bin/python tools/vocab_ref_count.py [--gguf PATH] [--data FILE] [-n 500]

Writes tests/fixtures/vocab/gsm8k_train_ref.json: for the first N records of
GSM8K train (question -> user, answer -> assistant), rendered with the GGUF's
own tokenizer.chat_template by jinja2 (transformers' sandbox settings, default
system message as the template inserts it), tokenized by Hugging Face
`tokenizers`, and counted over the assistant loss mask:
  total tokens, assistant tokens, distinct ids, sha256 of the int64
  little-endian frequency vector [vocab], the top-200 (id, count) pairs,
  and the same again with a --max-seq-len cut (samples longer are skipped).

Reference tokenizer: the GGUF's vocabulary and merges in a `tokenizers` BPE
model with SmolLM2's hub pre-tokenizer (Digits(individual_digits=True) +
ByteLevel), built by tools/gen_tokenizer_fixtures.build_reference. Not
transformers' AutoTokenizer(gguf_file=...): its GGUF converter drops the
Digits step for tokenizer.ggml.pre = "smollm", so it splits "123" unlike the
real SmolLM2 tokenizer; on GSM8K (digits everywhere) it would count different
tokens. The script reports how many samples that converter would tokenize
differently (--check-transformers), to document the divergence.

Assistant mask, computed independently of specd's segment layout: for the
assistant message at index i, the rendering of messages[:i] with
add_generation_prompt=True is a prefix of the full rendering; the content
starts where that prefix ends and is followed by "<|im_end|>". A token is in
the mask if its first character lies in [content start, content end] (the
<|im_end|> starts exactly at content end): the content and its closing
end-of-turn token, which is what a draft head is trained to predict.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import jinja2
import jinja2.sandbox
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gen_tokenizer_fixtures import build_reference, read_gguf  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "vocab", "gsm8k_train_ref.json")
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "prompts", "gsm8k_train.jsonl")


def render(env, tpl, messages, gen):
    return env.from_string(tpl).render(messages=messages, add_generation_prompt=gen)


def count(tok, env, tpl, convs, vocab, max_seq_len):
    freq = np.zeros(vocab, dtype=np.int64)
    total = assistant = processed = skipped = 0
    for msgs in convs:
        full = render(env, tpl, msgs, False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            pre = render(env, tpl, msgs[:i], True)
            assert full.startswith(pre), "prefix rendering is not a prefix"
            cs, ce = len(pre), len(pre) + len(m["content"])
            assert full[cs:ce] == m["content"] and full.startswith("<|im_end|>", ce)
            assert "<|" not in m["content"]  # content must not hold special-token text here
            spans.append((cs, ce))
        tok.encode_special_tokens = False
        enc = tok.encode(full, add_special_tokens=False)
        n = len(enc.ids)
        if max_seq_len and n > max_seq_len:
            skipped += 1
            continue
        processed += 1
        total += n
        for (a, _), tid in zip(enc.offsets, enc.ids):
            if any(cs <= a <= ce for cs, ce in spans):
                freq[tid] += 1
                assistant += 1
    order = sorted(range(vocab), key=lambda i: (-int(freq[i]), i))
    top = [[i, int(freq[i])] for i in order[:200] if freq[i] > 0]
    return {
        "max_seq_len": max_seq_len,
        "processed": processed,
        "skipped_long": skipped,
        "total_tokens": total,
        "assistant_tokens": assistant,
        "distinct": int((freq > 0).sum()),
        "freq_sha256": hashlib.sha256(freq.astype("<i8").tobytes()).hexdigest(),
        "top200": top,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--data", default=DATA)
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--cut", type=int, default=256, help="the --max-seq-len of the second count")
    ap.add_argument("--check-transformers", action="store_true")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    tokens, types, merges, tpl = read_gguf(a.gguf)
    tok = build_reference(tokens, types, merges)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    with open(a.data, "rb") as f:
        lines = [ln for ln in f.read().split(b"\n") if ln.strip()][: a.n]
    convs = []
    for ln in lines:
        r = json.loads(ln)
        convs.append([{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}])
    t0 = time.time()
    res = {
        "data": os.path.basename(a.data),
        "n_records": len(convs),
        "data_sha256": hashlib.sha256(b"".join(ln + b"\n" for ln in lines)).hexdigest(),
        "vocab": len(tokens),
        "reference": "jinja2 render of tokenizer.chat_template + HF tokenizers (GGUF vocab/merges, smollm pre-tokenizer); "
                     "mask by prefix rendering",
        "counts": [count(tok, env, tpl, convs, len(tokens), 0), count(tok, env, tpl, convs, len(tokens), a.cut)],
    }
    dt = time.time() - t0
    print(f"reference: {res['counts'][0]['total_tokens']} tokens x2 passes in {dt:.1f} s "
          f"({2 * res['counts'][0]['total_tokens'] / dt:.0f} tokens/s incl. rendering)", file=sys.stderr)
    if a.check_transformers:
        from transformers import AutoTokenizer
        d = os.path.dirname(os.path.realpath(a.gguf))
        tf = AutoTokenizer.from_pretrained(d, gguf_file=os.path.basename(os.path.realpath(a.gguf)))
        diff = sum(tf(render(env, tpl, c, False), add_special_tokens=False)["input_ids"] !=
                   tok.encode(render(env, tpl, c, False), add_special_tokens=False).ids for c in convs)
        print(f"transformers' GGUF tokenizer differs from the reference on {diff} of {len(convs)} samples",
              file=sys.stderr)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(json.dumps({k: v for k, v in res["counts"][0].items() if k != "top200"}))
    print(json.dumps({k: v for k, v in res["counts"][1].items() if k != "top200"}))


if __name__ == "__main__":
    main()
