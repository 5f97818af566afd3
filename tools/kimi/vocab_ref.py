#!/usr/bin/env python3
"""vocab_ref.py: the reference draft vocabulary of the Kimi miniature's EAGLE-3 head.

What it owns
    An implementation of `specd vocab count` + `specd vocab build` for the Kimi tokenizer that
    shares no code with specd: the `tiktoken` package over Kimi's ranks (tools/kimi/kimi_tok.py),
    jinja2 rendering of tools/kimi/chat_template.jinja, and the selection rule of REFERENCE
    section 2 / docs/vocab.md written here in numpy. Its output,
    tests/fixtures/kimi/draft_vocab_ref.json, is what the CI setup step
    tests/kimi_c/make_head_fixture.py compares the real `specd vocab` output against before it
    builds the head (tools/kimi/make_head.py) from specd's map.

Counting (the training loss mask)
    Each GSM8K train record becomes [user: question, assistant: answer], rendered WITHOUT a
    generation prompt and without a default system turn (the miniature's template takes the
    default as a variable; Hugging Face's apply_chat_template leaves it undefined, so no system
    turn is rendered). Message text is encoded as plain text; the counted tokens are the
    assistant content's ids and the <|im_end|> (163586) that closes it, never the role header
    or the empty <think></think> of a history turn.

Building (REFERENCE section 2, docs/vocab.md "build")
    forced ids: [EOS] 163585, <|im_end|> 163586 and the chat-structure specials <|im_user|>,
    <|im_assistant|>, <|im_system|>, <|im_middle|>, <think>, </think>; then the most frequent ids
    with a count > 0 (ties: lower id) until draft_vocab ids are kept; then the lowest unused ids
    that are not special (id < 163584). used = kept ids ascending, d2t[i] = used[i] - i (int64
    offsets), t2d[used] = true.

Needs tiktoken, jinja2, numpy (/work/venv-tools), ../shared/data (tokenizer, prompts).
Usage: /work/venv-tools/bin/python tools/kimi/vocab_ref.py [--data FILE] [--draft-vocab 32000]
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kimi_tok as kt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "prompts", "gsm8k_train.jsonl")
OUT = os.path.join(REPO, "tests", "fixtures", "kimi", "draft_vocab_ref.json")
TARGET_VOCAB = 163840
FORCED = [kt.EOS, kt.IM_END, kt.IM_USER, kt.IM_ASSISTANT, kt.IM_SYSTEM, kt.IM_MIDDLE, kt.THINK, kt.THINK_END]


def assistant_ids(question: str, answer: str):
    """(all ids of the rendering, the loss-mask ids) for one GSM8K record."""
    msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    text = kt.render(msgs, add_generation_prompt=False, default_system="", mark=True)
    enc = kt.encoding()
    ids, mask, rest, seg = [], [], text, 0
    while rest:
        a = rest.find(kt.S_OPEN)
        if a < 0:
            ids += enc.encode(rest, allowed_special="all")
            break
        ids += enc.encode(rest[:a], allowed_special="all")
        b = rest.index(kt.S_CLOSE, a)
        body = enc.encode_ordinary(rest[a + 1:b])
        rest = rest[b + 1:]
        if seg == 1:  # the assistant's content, closed by <|im_end|>
            tail = enc.encode(rest, allowed_special="all")
            assert tail and tail[0] == kt.IM_END, tail[:3]
            mask = body + [kt.IM_END]
        ids += body
        seg += 1
    assert seg == 2
    return ids, mask


def build(freq: np.ndarray, n: int):
    kept = list(dict.fromkeys(FORCED))
    ks = set(kept)
    order = np.lexsort((np.arange(len(freq)), -freq))   # count descending, then id ascending
    seen = int((freq > 0).sum())
    for i in order[:seen]:
        if len(kept) == n:
            break
        if int(i) not in ks:
            kept.append(int(i))
            ks.add(int(i))
    n_by_freq = len(kept)
    fill = []
    i = 0
    while len(kept) < n:
        if i not in ks and i < kt.N_BASE:
            kept.append(i)
            ks.add(i)
            fill.append(i)
        i += 1
    used = np.array(sorted(kept), dtype=np.int64)
    d2t = used - np.arange(n, dtype=np.int64)
    t2d = np.zeros(len(freq), dtype=np.bool_)
    t2d[used] = True
    return used, d2t, t2d, n_by_freq, fill


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    raw = open(a.data, "rb").read()
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    freq = np.zeros(TARGET_VOCAB, dtype=np.int64)
    total = assistant = 0
    t0 = time.time()
    for ln in lines:
        r = json.loads(ln)
        ids, mask = assistant_ids(r["question"], r["answer"])
        total += len(ids)
        assistant += len(mask)
        np.add.at(freq, np.array(mask, dtype=np.int64), 1)
    dt = time.time() - t0
    used, d2t, t2d, n_by_freq, fill = build(freq, a.draft_vocab)
    order = np.lexsort((np.arange(TARGET_VOCAB), -freq))
    res = {
        "what": "reference count + draft vocabulary for the Kimi miniature's EAGLE-3 head (tools/kimi/vocab_ref.py)",
        "reference": "tiktoken (Kimi ranks, Kimi's pattern) + jinja2 (tools/kimi/chat_template.jinja, no generation "
                     "prompt, no default system) + numpy selection rule (REFERENCE section 2)",
        "data": os.path.basename(a.data),
        "data_sha256": hashlib.sha256(raw).hexdigest(),
        "n_records": len(lines),
        "target_vocab": TARGET_VOCAB,
        "draft_vocab": a.draft_vocab,
        "total_tokens": total,
        "assistant_tokens": assistant,
        "distinct": int((freq > 0).sum()),
        "freq_sha256": hashlib.sha256(freq.astype("<i8").tobytes()).hexdigest(),
        "top50": [[int(i), int(freq[i])] for i in order[:50]],
        "forced": FORCED,
        "kept_by_frequency_or_forced": n_by_freq,
        "filled": len(fill),
        "fill_range": [fill[0], fill[-1]] if fill else None,
        "used_first20": [int(x) for x in used[:20]],
        "used_last20": [int(x) for x in used[-20:]],
        "d2t_sha256": hashlib.sha256(d2t.astype("<i8").tobytes()).hexdigest(),
        "t2d_sha256": hashlib.sha256(t2d.astype(np.uint8).tobytes()).hexdigest(),
    }
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(f"{len(lines)} records, {total} tokens, {assistant} assistant, {res['distinct']} distinct, "
          f"{len(fill)} filled ({dt:.1f} s) -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
