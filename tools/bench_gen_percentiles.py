#!/usr/bin/env python3
"""Writes tests/fixtures/bench/percentiles.json: reference summary statistics
computed by numpy (np.percentile default method "linear", np.mean, np.std with
ddof=0, np.median) on fixed arrays, for tests/bench/test_bench_stats.c.

Run: python tools/bench_gen_percentiles.py  (any python with numpy)
"""
import json
import os

import numpy as np

QS = [0, 1, 10, 25, 33.3, 50, 66.6, 75, 90, 95, 99, 99.9, 100]


def case(name, x):
    x = [float(v) for v in x]
    a = np.asarray(x, dtype=np.float64)
    return {
        "name": name,
        "x": x,
        "q": QS,
        "percentile": [float(np.percentile(a, q)) for q in QS],
        "mean": float(np.mean(a)),
        "std": float(np.std(a)),
        "median": float(np.median(a)),
        "min": float(np.min(a)),
        "max": float(np.max(a)),
    }


def main():
    rng = np.random.default_rng(20261129)
    cases = [
        case("single", [42.5]),
        case("pair", [3.0, 1.0]),
        case("ties", [5, 5, 5, 1, 1, 9, 9, 9, 9]),
        case("small_unsorted", [12.3, -4.0, 7.75, 0.0, 100.0, 3.5, 3.5]),
        # latency-like: log-normal milliseconds, 257 samples (odd, non-round n)
        case("lognormal_257", np.round(rng.lognormal(3.0, 0.6, 257), 6)),
        # ITL-like: many small values with a heavy tail, 1000 samples
        case("heavy_tail_1000", np.round(np.concatenate([rng.exponential(8.0, 990),
                                                         rng.uniform(200, 900, 10)]), 6)),
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(root, "tests", "fixtures", "bench", "percentiles.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"generator": "tools/bench_gen_percentiles.py", "numpy": np.__version__,
                   "cases": cases}, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
