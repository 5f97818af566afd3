"""Helpers shared by the specd-bench end-to-end tests: free ports, waiting for
/health, scraping /metrics counters by name suffix, running specd-bench."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

SKIP = 77


def skip(msg):
    print("SKIP: " + msg)
    sys.exit(SKIP)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(base, proc, timeout):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited with %s before /health was 200" % proc.returncode)
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001 - any failure means "not yet"
            last = e
        time.sleep(0.2)
    raise RuntimeError("no 200 from %s/health within %ss (last: %s)" % (base, timeout, last))


def metric_sum(base, suffix):
    """Sum of every sample whose metric name ends with suffix (any labels);
    None when the server exposes no such metric. Parsed independently of
    bench/prom.c so the test does not trust the code it checks."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(suffix):
            value = line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1]
            total += float(value)
            found = True
    return total if found else None


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
