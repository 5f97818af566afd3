#!/usr/bin/env python3
"""tp_cost.py: decode time per token (TPOT) of `specd serve` at TP 1 and TP N, for the cost of tensor
parallelism on the CPU. A measuring tool, not a ctest test.

Each configuration: one server, 5 streamed greedy completions of 128 tokens (ignore_eos) after the prompt
"Once upon a time"; TPOT = (last chunk - first chunk) / (chunks - 1); the median of the 5 is printed.

Usage (from the repository root, after a build):
  SPECD_BUILD_DIR=build .venv/bin/python tests/perf/tp_cost.py MODEL 'NAME:FLAGS' ['NAME:FLAGS' ...]
e.g. tests/perf/tp_cost.py models/SmolLM2-135M-Instruct.Q4_1.gguf 'tp1x2:--threads 2' 'tp3x1:--threads 1 --tensor-parallel-size 3'
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402


def tpot(model, flags, reps=5, tokens=128):
    s = sp.Server(["--max-model-len", "512", "--kv-cache-memory", "32M", "--served-model-name", "m", *flags],
                  model=model, omp_threads=None)
    try:
        out = []
        for _ in range(reps):
            first, n = None, 0
            for _ch in s.client().completions.create(model="m", prompt="Once upon a time", max_tokens=tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True}):
                first = first or time.time()
                n += 1
            out.append((time.time() - first) / max(1, n - 1) * 1000)
        return sorted(out)[reps // 2]
    finally:
        s.stop()


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for spec in sys.argv[2:]:
        name, _, flags = spec.partition(":")
        print(f"{name}: TPOT {tpot(sys.argv[1], flags.split()):.3f} ms (median of 5)", flush=True)


if __name__ == "__main__":
    main()
