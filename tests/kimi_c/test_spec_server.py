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
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

MINI = os.environ.get("KIMI_C_MINI_DIR", "")
TARGET, HEAD = os.path.join(MINI, "k25"), os.path.join(MINI, "kimi_head")
COMMON = ["--served-model-name", "kimi-mini", "--max-model-len", "256", "--kv-cache-memory", "32M",
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


def ask(srv, msgs):
    st, body, _ = srv.raw("POST", "/v1/chat/completions", {
        "model": "kimi-mini", "messages": msgs, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert st == 200, (st, body[:300])
    r = json.loads(body)
    c = r["choices"][0]
    return c["message"]["content"], c["finish_reason"], r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


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
    m = sp.parse_metrics(srv.raw("GET", "/metrics")[1].decode())
    p = "specd_spec_decode_"
    return (int(m.get(p + "num_drafts_total", 0)), int(m.get(p + "num_draft_tokens_total", 0)),
            int(m.get(p + "num_accepted_tokens_total", 0)))


def main() -> int:
    if not os.access(sp.SPECD, os.X_OK):
        print(f"SKIP: no {sp.SPECD}")
        return 77
    for p in (os.path.join(TARGET, "tiktoken.model"), os.path.join(HEAD, "config.json")):
        if not os.path.exists(p):
            print(f"SKIP: {p} missing (kimi_c_mini_setup / kimi_c_head_setup need ../shared/data)")
            return 77
    plain = sp.Server(COMMON, model=TARGET, log_prefix="specd_kimi_plain_")
    spec = None
    try:
        spec = sp.Server([*COMMON, "--draft", HEAD, "--num-speculative-tokens", "3"], model=TARGET,
                         log_prefix="specd_kimi_spec_")
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


if __name__ == "__main__":
    sys.exit(main())
