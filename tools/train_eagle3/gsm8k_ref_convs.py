#!/usr/bin/env python3
"""Conversations from GSM8K train with the data set's own answers (calculator
annotations <<...>> removed, "#### N" -> "The answer is N."), for when the
target's self-distilled responses (prepare_data.py) are too few: the trainer's
soft targets still come from the target's own distribution at every position.
Usage: gsm8k_ref_convs.py --start 1400 --count 600 --out data/train/gsm8k_ref.jsonl"""
import argparse, json, os, re

ap = argparse.ArgumentParser()
ap.add_argument("--start", type=int, default=1400)
ap.add_argument("--count", type=int, default=600)
ap.add_argument("--out", required=True)
ap.add_argument("--data", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "../../../shared/data/prompts/gsm8k_train.jsonl"))
a = ap.parse_args()
with open(a.data) as f, open(a.out, "w") as out:
    for i, line in enumerate(f):
        if i < a.start:
            continue
        if i >= a.start + a.count:
            break
        o = json.loads(line)
        ans = re.sub(r"<<[^>]*>>", "", o["answer"])
        ans = re.sub(r"\n?#### *(.*)$", r"\nThe answer is \1.", ans.strip())
        out.write(json.dumps({"id": f"gsm8k_train:{i}", "source": "gsm8k_train_reference",
                              "messages": [{"role": "user", "content": o["question"]},
                                           {"role": "assistant", "content": ans}]}) + "\n")
