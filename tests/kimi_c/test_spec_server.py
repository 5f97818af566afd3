#!/usr/bin/env python3
"""test_spec_server.py (kimi_c_spec_server): speculative decoding on the Kimi miniature through the real
`specd serve` is lossless: two servers on loopback, PLAIN (`specd serve OUT/k25`) and SPEC (`specd serve
OUT/k25 --draft OUT/kimi_head --num-speculative-tokens 3`, the miniature's EAGLE-3 head written by the
kimi_c_head_setup fixture, loaded by the server's own loader path: server/bundle.c eagle3_load +
engine_set_proposer). Reference: PLAIN answering each request alone.

  - batch 1: 8 chat requests (Kimi chat template: English, Chinese, Japanese, code, emoji, digits, a
    multi-turn conversation, a system prompt) sent one at a time to SPEC, temperature 0, 20 tokens:
    content, finish_reason and usage identical to PLAIN's;
  - batch 8: the same 8 requests sent concurrently to SPEC (and to PLAIN): identical again;
  - /metrics of SPEC: draft tokens were proposed (speculation really ran), accepted <= draft tokens;
    PLAIN reports no drafts.

Needs $SPECD_BUILD_DIR/server/specd and the miniature with its head (KIMI_C_MINI_DIR); exits 77 without
them (no ../shared/data: no tokenizer, no head).
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

SPECD = os.environ.get("SPECD_BIN") or os.path.join(os.environ.get("SPECD_BUILD_DIR", ""), "server", "specd")
MINI = os.environ.get("KIMI_C_MINI_DIR", "")
# KIMI_C_TARGET / KIMI_C_SERVE_ARGS: another miniature and extra flags for both servers (ctest
# kimi_c_spec_server_tp4: the 8-head "wide8" variant at --tensor-parallel-size 4, the head on rank 0)
TARGET, HEAD = os.path.join(MINI, os.environ.get("KIMI_C_TARGET", "k25")), os.path.join(MINI, "kimi_head")
COMMON = [*os.environ.get("KIMI_C_SERVE_ARGS", "").split(),
          "--served-model-name", "kimi-mini", "--max-model-len", "256", "--kv-cache-memory", "32M",
          "--threads", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
MAX_TOKENS = 20

CONVS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "你好，请介绍一下你自己。"}],
    [{"role": "user", "content": "日本の首都はどこですか？"}],
    [{"role": "user", "content": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n# explain"}],
    [{"role": "user", "content": "Rate this 🍕🍕🍕 out of 10!!"}],
    [{"role": "user", "content": "Compute 12345 * 6789 and 3.14159 / 2.71828."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about <|im_end|> tokens."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
]


class Server:
    """`specd serve MODEL --port P ARGS` on a free loopback port, output in a log file, /health polled."""

    def __init__(self, model, args, name):
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            self.port = so.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix=f"specd_kimi_{name}_", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([SPECD, "serve", model, "--port", str(self.port), *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"specd serve did not come up: {self.read_log()}")
            try:
                if self.raw("GET", "/health", timeout=5)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)

    def raw(self, method, path, body=None, timeout=300):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=json.dumps(body) if body is not None else None,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def read_log(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, val = line.rsplit(" ", 1) if "}" not in line else (line[:line.rindex("}") + 1],
                                                                       line[line.rindex("}") + 1:].split()[0])
            out[name.strip()] = float(val)
    return out


def ask(srv, msgs):
    st, body = srv.raw("POST", "/v1/chat/completions", {
        "model": "kimi-mini", "messages": msgs, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert st == 200, (st, body[:300])
    r = json.loads(body)
    c = r["choices"][0]
    # the K2.5 template thinks by default: the text is split into reasoning_content and content (issue 21);
    # both are compared
    text = repr((c["message"].get("reasoning_content"), c["message"]["content"]))
    return text, c["finish_reason"], r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


def concurrent(srv):
    out = [None] * len(CONVS)

    def one(i):
        out[i] = ask(srv, CONVS[i])

    th = [threading.Thread(target=one, args=(i,)) for i in range(len(CONVS))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out


def spec_counters(srv):
    m = parse_metrics(srv.raw("GET", "/metrics")[1].decode())
    p = "specd_spec_decode_"
    return (int(m.get(p + "num_drafts_total", 0)), int(m.get(p + "num_draft_tokens_total", 0)),
            int(m.get(p + "num_accepted_tokens_total", 0)))


def main() -> int:
    if not os.access(SPECD, os.X_OK):
        print(f"SKIP: no {SPECD}")
        return 77
    for p in (os.path.join(TARGET, "tiktoken.model"), os.path.join(HEAD, "config.json")):
        if not os.path.exists(p):
            print(f"SKIP: {p} missing (kimi_c_mini_setup / kimi_c_head_setup need ../shared/data)")
            return 77
    plain = Server(TARGET, COMMON, "plain")
    spec = None
    try:
        spec = Server(TARGET, [*COMMON, "--draft", HEAD, "--num-speculative-tokens", "3"], "spec")
        ref = [ask(plain, c) for c in CONVS]
        for i, r in enumerate(ref):
            print(f"plain #{i}: {r[3]} tokens, {r[1]}, {r[0][:40]!r}")
        one = [ask(spec, c) for c in CONVS]
        c1 = spec_counters(spec)
        eight = concurrent(spec)
        c8 = spec_counters(spec)
        plain8 = concurrent(plain)
        bad = 0
        for name, got in (("spec batch 1", one), ("spec 8 concurrent", eight), ("plain 8 concurrent", plain8)):
            for i, (g, r) in enumerate(zip(got, ref)):
                if g != r:
                    bad += 1
                    print(f"FAIL: {name} request {i}: {g!r} != plain alone {r!r}")
        print(f"spec metrics after batch 1: drafts {c1[0]}, draft tokens {c1[1]}, accepted {c1[2]}")
        print(f"spec metrics after 8 concurrent: drafts {c8[0]}, draft tokens {c8[1]}, accepted {c8[2]}")
        assert c1[1] > 0 and c8[1] > c1[1], "speculation did not run"
        assert c8[2] <= c8[1] <= 3 * c8[0]
        assert spec_counters(plain)[1] == 0
        if bad:
            return 1
        print(f"kimi_c_spec_server: {len(CONVS)} requests x {MAX_TOKENS} tokens: speculative (batch 1 and 8) == "
              f"plain greedy")
        return 0
    finally:
        for s in (plain, spec):
            if s is not None:
                rc = s.stop()
                if rc != 0:
                    print(s.read_log())
                else:
                    os.unlink(s.log.name)


if __name__ == "__main__":
    sys.exit(main())
