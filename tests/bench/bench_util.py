"""Helpers shared by the specd-bench end-to-end tests: free ports and waiting
for /health (from tests/pyutil/specd_server.py, the tests' one copy), scraping
/metrics counters by name suffix, running specd-bench."""
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

SKIP = 77


def skip(msg):
    print("SKIP: " + msg)
    sys.exit(SKIP)


free_port = sp.free_port


def wait_health(base, proc, timeout):
    """GET BASE/health until 200 (BASE: http://127.0.0.1:PORT); RuntimeError when PROC exits first."""
    sp.wait_health(urllib.parse.urlsplit(base).port, proc, timeout, poll=0.2)


def metric_sum(base, suffix):
    """Sum of every sample whose metric name ends with suffix (any labels);
    None when the server exposes no such metric. Parsed independently of
    bench/prom.c so the test does not trust the code it checks."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        samples = sp.parse_metrics(r.read().decode())
    found = [v for k, v in samples.items() if k.split("{", 1)[0].endswith(suffix)]
    return sum(found) if found else None


def bench_binary():
    build = os.environ.get("SPECD_BUILD_DIR", "build")
    b = os.path.join(build, "bench", "specd-bench")
    if not os.path.exists(b):
        skip("specd-bench not built at " + b)
    return b


def run_bench(args, timeout=600):
    p = subprocess.run([bench_binary()] + args, capture_output=True, text=True, timeout=timeout)
    print(p.stdout)
    if p.stderr:
        print(p.stderr, file=sys.stderr)
    return p


def load(path):
    with open(path) as f:
        return json.load(f)
