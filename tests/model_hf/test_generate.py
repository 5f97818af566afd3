#!/usr/bin/env python3
"""test_generate.py (model_hf_generate): a Hugging Face Llama directory end to end through the `specd`
binary: the tiny "f32" checkpoint of tools/gen_llama_hf_mini.py with the tiny byte-level BPE tokenizer
(tokenizer.json + tokenizer_config.json with SmolLM2's ChatML template) committed in
tests/fixtures/model_hf/tokenizer/. Reference: tests/fixtures/model_hf/generate.json, written by
tools/gen_llama_hf_ref.py with transformers (AutoTokenizer, apply_chat_template, LlamaForCausalLM greedy).

  - `specd tokenize --model DIR` of the plain prompt == transformers' ids;
  - `specd tokenize` of the chat rendered by jinja2 from tokenizer_config.json's template == the ids of
    transformers' apply_chat_template;
  - `specd generate DIR --chat MSG` and `--prompt TEXT` (greedy, 16 tokens, --ignore-eos) print exactly
    transformers' greedy continuation decoded with skip_special_tokens.

Needs $SPECD_BUILD_DIR/server/specd and MODEL_HF_MINI_DIR (the model_hf_setup fixture); exits 77 without.
"""
import json
import os
import subprocess
import sys

import jinja2

SRC = os.environ.get("SPECD_SOURCE_DIR", ".")
SPECD = os.environ.get("SPECD_BIN") or os.path.join(os.environ.get("SPECD_BUILD_DIR", ""), "server", "specd")
MINI = os.environ.get("MODEL_HF_MINI_DIR", "")


def run(args):
    r = subprocess.run([SPECD] + args, capture_output=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAIL: specd {' '.join(args)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout


def main():
    ref = json.load(open(os.path.join(SRC, "tests", "fixtures", "model_hf", "generate.json"), encoding="utf-8"))
    d = os.path.join(MINI, ref["dir"])
    if not os.path.exists(SPECD) or not os.path.exists(os.path.join(d, "tokenizer.json")):
        print(f"SKIP: needs {SPECD} and {d}/tokenizer.json (model_hf_setup)")
        return 77
    tcfg = json.load(open(os.path.join(d, "tokenizer_config.json"), encoding="utf-8"))
    failures = 0
    for case in ref["cases"]:
        if case["kind"] == "chat":
            text = jinja2.Environment().from_string(tcfg["chat_template"]).render(
                messages=[{"role": "user", "content": case["text"]}], add_generation_prompt=True)
        else:
            text = case["text"]
        ids = json.loads(run(["tokenize", "--model", d, "--text", text]))
        if ids != case["prompt_ids"]:
            print(f"FAIL {case['kind']}: prompt ids {ids} != transformers {case['prompt_ids']}")
            failures += 1
        flag = "--chat" if case["kind"] == "chat" else "--prompt"
        out = run(["generate", d, flag, case["text"], "--max-tokens", str(ref["n_new"]), "--ignore-eos",
                   "--temperature", "0", "--threads", "1", "--log-level", "warn"])
        want = case["decoded"].encode("utf-8")
        if out != want:
            print(f"FAIL {case['kind']}: specd generate printed {out!r}, transformers greedy {want!r}")
            failures += 1
        else:
            print(f"ok {case['kind']}: {len(ids)} prompt ids, {ref['n_new']} greedy tokens -> {out!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
