#!/usr/bin/env python3
"""Batch-1 prompt and decode throughput: specd's engine vs llama.cpp on the
same GGUF with the same thread count, in one run, alternating (so machine
load hits both alike). specd: tests/perf/perf_model (random prompt ids, one
pass over the prompt, then one token per step through the paged cache).
llama.cpp: llama-cpp-python's Llama.eval with the same shapes.

Usage: tools/bench_engine.py [--threads 2] [--prompt 128] [--decode 64] [--repeats 3]
         [--llamacpp-python /work/venv-llamacpp/bin/python] [--perf-model build/tests/perf/perf_model]
"""
import argparse, json, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_SNIPPET = r"""
import sys, time, json
from llama_cpp import Llama
path, T, P, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=T, n_threads_batch=T, n_ctx=P + D + 16, n_batch=512, verbose=False)
toks = [100 + (i * 7919) % 40000 for i in range(P + D)]
t0 = time.perf_counter(); llm.eval(toks[:P]); t1 = time.perf_counter()
for i in range(D):
    llm.eval([toks[P + i]])
t2 = time.perf_counter()
print(json.dumps({"prefill_tok_s": P / (t1 - t0), "decode_tok_s": D / (t2 - t1)}))
"""


def run_specd(a):
    out = subprocess.run([a.perf_model, a.model, str(a.threads), str(a.prompt), str(a.decode)], capture_output=True,
                         text=True, check=True).stdout
    pre = float(re.search(r"prefill \d+ tokens: ([\d.]+) tok/s", out).group(1))
    dec = float(re.search(r"decode \d+ steps: ([\d.]+) tok/s", out).group(1))
    return {"prefill_tok_s": pre, "decode_tok_s": dec}


def run_llama(a):
    out = subprocess.run([a.llamacpp_python, "-c", LLAMA_SNIPPET, a.model, str(a.threads), str(a.prompt),
                          str(a.decode)], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llamacpp-python", default="/work/venv-llamacpp/bin/python")
    ap.add_argument("--perf-model", default=os.path.join(ROOT, "build/tests/perf/perf_model"))
    a = ap.parse_args()
    res = {"specd": [], "llama.cpp": []}
    for _ in range(a.repeats):
        res["specd"].append(run_specd(a))
        res["llama.cpp"].append(run_llama(a))
    print(f"threads {a.threads}, prompt {a.prompt}, decode {a.decode}, {a.repeats} alternating repeats (median)")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill_tok_s", "decode_tok_s")} for k, v in res.items()}
    for k, v in med.items():
        print(f"  {k:10s} prefill {v['prefill_tok_s']:8.1f} tok/s   decode {v['decode_tok_s']:7.1f} tok/s")
    print(f"  ratio specd/llama.cpp: prefill {med['specd']['prefill_tok_s'] / med['llama.cpp']['prefill_tok_s']:.2f}x, "
          f"decode {med['specd']['decode_tok_s'] / med['llama.cpp']['decode_tok_s']:.2f}x")
    print(json.dumps({"raw": res, "median": med}))


if __name__ == "__main__":
    main()
