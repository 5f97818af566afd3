#!/usr/bin/env python3
"""Batch-1 prompt and decode throughput: specd's engine vs llama.cpp on the
same GGUF with the same thread count, in one run, alternating (so machine
load hits both alike). specd: tests/perf/perf_model (random prompt ids, one
pass over the prompt, then one token per step through the paged cache).
llama.cpp: llama-cpp-python's Llama.eval with the same shapes.
Both wall tok/s and CPU-time tok/s (1000 / CPU ms per token, all threads of
the process) are reported; on a shared machine compare the CPU-time figures,
which other jobs' load disturbs far less than wall time.

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
t0, c0 = time.perf_counter(), time.process_time(); llm.eval(toks[:P]); t1, c1 = time.perf_counter(), time.process_time()
for i in range(D):
    llm.eval([toks[P + i]])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"prefill_tok_s": P / (t1 - t0), "decode_tok_s": D / (t2 - t1),
                  "prefill_cpu_tok_s": P / (c1 - c0), "decode_cpu_tok_s": D / (c2 - c1)}))
"""


def run_specd(a):
    out = subprocess.run([a.perf_model, a.model, str(a.threads), str(a.prompt), str(a.decode)], capture_output=True,
                         text=True, check=True).stdout
    pre = re.search(r"prefill \d+ tokens: ([\d.]+) tok/s wall, ([\d.]+) ms CPU/token", out)
    dec = re.search(r"decode \(median of \d+ steps\): ([\d.]+) tok/s wall \([\d.]+ ms/step\), ([\d.]+) ms CPU/step", out)
    ver = re.search(r"verify k=3 \(4 tokens.*= ([\d.]+)x a decode step; [\d.]+ ms CPU = ([\d.]+)x", out)
    if not pre or not dec:
        sys.exit("perf_model's output did not parse:\n" + out)
    return {"prefill_tok_s": float(pre.group(1)), "decode_tok_s": float(dec.group(1)),
            "prefill_cpu_tok_s": 1e3 / float(pre.group(2)), "decode_cpu_tok_s": 1e3 / float(dec.group(2)),
            "verify4_per_decode": float(ver.group(1)) if ver else None,
            "verify4_per_decode_cpu": float(ver.group(2)) if ver else None}


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
    keys = ("prefill_tok_s", "decode_tok_s", "prefill_cpu_tok_s", "decode_cpu_tok_s")
    med = {k: {m: statistics.median(r[m] for r in v) for m in keys} for k, v in res.items()}
    for k, v in med.items():
        print(f"  {k:10s} prefill {v['prefill_tok_s']:8.1f} tok/s   decode {v['decode_tok_s']:7.1f} tok/s   "
              f"(CPU time: prefill {v['prefill_cpu_tok_s']:7.1f}, decode {v['decode_cpu_tok_s']:6.1f} tok/s)")
    r = {m: med["specd"][m] / med["llama.cpp"][m] for m in keys}
    print(f"  ratio specd/llama.cpp: prefill {r['prefill_tok_s']:.2f}x, decode {r['decode_tok_s']:.2f}x (wall); "
          f"prefill {r['prefill_cpu_tok_s']:.2f}x, decode {r['decode_cpu_tok_s']:.2f}x (CPU time)")
    v = [r["verify4_per_decode_cpu"] for r in res["specd"] if r.get("verify4_per_decode_cpu")]
    if v:
        print(f"  specd verify of 4 tokens: {statistics.median(v):.2f}x a decode step (CPU time), "
              f"{statistics.median(r['verify4_per_decode'] for r in res['specd']):.2f}x (wall)")
    print(json.dumps({"raw": res, "median": med}))


if __name__ == "__main__":
    main()
