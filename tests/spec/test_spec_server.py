"""Speculative decoding through the real `specd serve --draft` (issue 4): stops inside accepted blocks.

Three servers on loopback: PLAIN (no draft), ZERO (--draft a head that always drafts the target token "0",
k = 5) and EOS (--draft a head that always drafts <|im_end|>, k = 5). The two heads are real EAGLE-3 head
files (tools/spec_const_head.py: the random head of tools/eagle3/make_random_head.py with norm.weight = 0,
so every draft logit is 0 and the draft is draft id 0, mapped by d2t to the chosen target id), loaded by
the real loader and run by the real draft forward. Since the drafts are known, the speculative block
structure of a request is known from the plain server's greedy tokens alone: `simulate` derives, per
request, the number of drafts, draft tokens, accepted tokens and accepted-per-position, and the test
demands that /metrics moved by exactly that much. That proves each case below really ends inside a
multi-token accepted block (and validates the constant-draft construction at the same time).

Checked against the plain server (same binary without a draft; its greedy output is the reference):
  - a stop string completed by the 3rd of 5 accepted drafts ("...5000" while the target keeps writing zeros):
    exact text, finish_reason, usage;
  - a stop token id (the "0" token) accepted as the 1st draft with 4 more acceptable drafts after it;
  - EOS (<|im_end|>) as the correction after 2 and after 4 accepted drafts (few-shot chat answers "300",
    "40000"), and EOS accepted as a draft (EOS head);
  - streaming: deltas concatenate to the non-streaming text, usage chunk equals the non-streaming usage,
    and a chunk carries a whole accepted block (>= 6 tokens: every accepted token is sent);
  - n = 2 with speculation: both choices equal the plain output, usage counts both;
  - /metrics spec counters: accepted <= draft tokens <= k * drafts, per-position counts non-increasing
    (chain drafting: position i+1 accepted implies position i accepted) and summing to the accepted count.
Needs $SPECD_BUILD_DIR/server/specd, the SmolLM2 GGUF and numpy (project venv); exits 77 otherwise.
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("SPECD_BUILD_DIR", "")
SRC = os.environ.get("SPECD_SOURCE_DIR", os.getcwd())
MODEL = os.environ.get("SPECD_MODEL_GGUF", "")
SPECD = os.path.join(BUILD, "server", "specd")
if __name__ == "__main__":
    if not os.access(SPECD, os.X_OK) or not os.path.exists(MODEL):
        print(f"skip: need {SPECD} and {MODEL}")
        sys.exit(77)
    try:
        import numpy  # noqa: F401
        import openai  # noqa: F401
    except ImportError as e:
        print(f"skip: {e}")
        sys.exit(77)

import openai  # noqa: E402
import pytest  # noqa: E402

K = 5
ZERO, EOS = "0", "<|im_end|>"   # token strings of the two heads' drafts
COMMON = ["--served-model-name", "m", "--max-model-len", "512", "--kv-cache-memory", "64M", "--threads", "1", "--shutdown-timeout", "60"]
COUNT_PROMPT = "Count by millions: 1000000, 2000000, 3000000,"
SHOTS = [{"role": "user", "content": "Write ten thousand in digits."}, {"role": "assistant", "content": "10000"},
         {"role": "user", "content": "Write two hundred in digits."}, {"role": "assistant", "content": "200"}]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, extra):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="specd_spec_", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([SPECD, "serve", MODEL, "--port", str(self.port), *COMMON, *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specd exited early ({self.proc.returncode}): {self.read_log()}")
            try:
                if self.raw("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("specd did not become healthy: " + self.read_log())

    def read_log(self):
        with open(self.log.name, "r", errors="replace") as f:
            return f.read()[-4000:]

    def raw(self, method, path, body=None, timeout=600):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                             timeout=600)

    def metrics(self):
        st, data = self.raw("GET", "/metrics")
        assert st == 200
        out = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, val = line.rsplit(" ", 1)
            out[name] = float(val)
        return out

    def spec(self):
        """(drafts, draft tokens, accepted, [accepted at position i for i < K]) from /metrics, once nothing runs.
        The engine publishes its counters at the end of a step, after the step's outputs went out: a client
        can hold its response before the counters of the step that finished it are visible. The published
        running/waiting gauges come in the same snapshot, so zero running means the counters are final."""
        deadline = time.time() + 60
        m = self.metrics()
        while m["specd_num_requests_running"] + m["specd_num_requests_waiting"] > 0 and time.time() < deadline:
            time.sleep(0.05)
            m = self.metrics()
        p = "specd_spec_decode_"
        per = [int(m.get(f'{p}num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)) for i in range(K)]
        return (int(m[p + "num_drafts_total"]), int(m[p + "num_draft_tokens_total"]),
                int(m[p + "num_accepted_tokens_total"]), per)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def make_head(token_id):
    d = tempfile.mkdtemp(prefix="specd_const_head_")
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "spec_const_head.py"), "--out", d,
                        "--token", str(token_id)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    return d


@pytest.fixture(scope="module")
def servers():
    plain = Server([])
    heads, spec = [], {}
    try:
        st, data = plain.raw("POST", "/tokenize", {"prompt": ZERO})
        zero_id = json.loads(data)["tokens"]
        assert len(zero_id) == 1, zero_id
        st, data = plain.raw("POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
        ids = json.loads(data)["tokens"]
        st, data = plain.raw("POST", "/tokenize", {"prompt": EOS})
        eos_id = json.loads(data)["tokens"]
        # one id, and the one the chat template ends each turn with
        assert len(eos_id) == 1 and eos_id[0] in ids, (eos_id, ids)
        for name, tid in (("zero", zero_id[0]), ("eos", eos_id[0])):
            heads.append(make_head(tid))
            spec[name] = Server(["--draft", heads[-1], "--num-speculative-tokens", str(K)])
        spec["zero_id"] = zero_id[0]
        yield plain, spec
    finally:
        for s in [plain] + [v for v in spec.values() if isinstance(v, Server)]:
            rc = s.stop()
            assert rc == 0, s.read_log()
        for d in heads:
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            os.rmdir(d)


def simulate(tokens, draft, max_tokens, k=K):
    """Spec counters of one greedy request whose emitted tokens are TOKENS (the plain server's, as token
    strings) when every draft is DRAFT: the first token comes from prefill; each later step drafts
    k_eff = min(k, max_tokens - emitted - 1) tokens, the leading ones equal to the target's tokens are
    accepted, then the correction (or the bonus) is emitted; a stop ends the block where it is emitted.
    Returns (drafts, draft tokens, accepted, per-position list, blocks as (start, accepted, emitted))."""
    drafts = dt = acc = 0
    per = [0] * k
    blocks = []
    i, n = 1, len(tokens)
    while i < n:
        ke = min(k, max_tokens - i - 1)
        if ke <= 0:
            i += 1
            continue
        a = 0
        while a < ke and i + a < n and tokens[i + a] == draft:
            a += 1
        drafts += 1
        dt += ke
        acc += a
        for j in range(a):
            per[j] += 1
        emitted = min(a + 1, n - i)
        blocks.append((i, a, emitted))
        i += emitted
    return drafts, dt, acc, per, blocks


def completion(srv, **kw):
    return srv.client().completions.create(model="m", temperature=0, logprobs=0, **kw)


def chat(srv, **kw):
    return srv.client().chat.completions.create(model="m", temperature=0, logprobs=True, **kw)


def spec_delta(srv, fn):
    before = srv.spec()
    out = fn()
    after = srv.spec()
    return out, (after[0] - before[0], after[1] - before[1], after[2] - before[2],
                 [b - a for a, b in zip(before[3], after[3])])


def check_counters(delta, tokens, draft, max_tokens):
    d, dt, acc, per, blocks = simulate(tokens, draft, max_tokens)
    assert delta == (d, dt, acc, per), f"/metrics moved by {delta}, the block simulation says {(d, dt, acc, per)}"
    return blocks


def test_stop_string_inside_accepted_block(servers):
    plain, spec = servers
    # plain greedy: " 4000000, 5000000, 6000000, ..." (digits are single tokens)
    kw = dict(prompt=COUNT_PROMPT, max_tokens=40, stop=["5000"])
    ref = completion(plain, **kw)
    got, delta = spec_delta(spec["zero"], lambda: completion(spec["zero"], **kw))
    r, g = ref.choices[0], got.choices[0]
    assert r.finish_reason == "stop" and r.text.endswith(", ") and "5" not in r.text, r.text
    assert (g.text, g.finish_reason, got.usage) == (r.text, r.finish_reason, ref.usage)
    # the plain run's tokens up to the stop: its own text + the tokens of "5000"; usage says how many
    full = completion(plain, prompt=COUNT_PROMPT, max_tokens=40).choices[0].logprobs.tokens
    tokens = full[:ref.usage.completion_tokens]
    assert "".join(tokens) == r.text + "5000"
    blocks = check_counters(delta, tokens, ZERO, 40)
    last = blocks[-1]
    # the stop ("5", then "000" accepted as drafts 1..3 of 5): 3 accepted, the 3rd completes the stop
    assert last[1] == 3 and last[2] == 3, blocks


def test_stop_token_id_first_of_accepted_block(servers):
    plain, spec = servers
    kw = dict(prompt=COUNT_PROMPT, max_tokens=40, extra_body={"stop_token_ids": [spec["zero_id"]]})
    ref = completion(plain, **kw)
    got, delta = spec_delta(spec["zero"], lambda: completion(spec["zero"], **kw))
    r, g = ref.choices[0], got.choices[0]
    assert r.finish_reason == "stop" and ref.usage.completion_tokens == 3, (r, ref.usage)   # " ", "4", "0"
    assert (g.text, g.finish_reason, got.usage) == (r.text, r.finish_reason, ref.usage)
    blocks = check_counters(delta, [" ", "4", ZERO], ZERO, 40)
    assert blocks[-1][1:] == (1, 1), blocks   # the stop is draft 1 of 5; drafts 2..5 are never emitted


@pytest.mark.parametrize("question,accepted", [("Write three thousand in digits.", 2),
                                               ("Write forty thousand in digits.", 4)])
def test_eos_correction_inside_block(servers, question, accepted):
    plain, spec = servers
    kw = dict(messages=SHOTS + [{"role": "user", "content": question}], max_tokens=40)
    ref = chat(plain, **kw)
    got, delta = spec_delta(spec["zero"], lambda: chat(spec["zero"], **kw))
    r, g = ref.choices[0], got.choices[0]
    assert r.finish_reason == "stop"
    assert (g.message.content, g.finish_reason, got.usage) == (r.message.content, r.finish_reason, ref.usage)
    tokens = [t.token for t in r.logprobs.content]
    assert tokens[-1] == EOS and len(tokens) == ref.usage.completion_tokens, tokens
    blocks = check_counters(delta, tokens, ZERO, 40)
    assert blocks[-1][1:] == (accepted, accepted + 1), blocks   # EOS right after `accepted` accepted zeros


def test_eos_accepted_as_draft(servers):
    plain, spec = servers
    kw = dict(messages=SHOTS + [{"role": "user", "content": "Write forty thousand in digits."}], max_tokens=40)
    ref = chat(plain, **kw)
    got, delta = spec_delta(spec["eos"], lambda: chat(spec["eos"], **kw))
    r, g = ref.choices[0], got.choices[0]
    assert (g.message.content, g.finish_reason, got.usage) == (r.message.content, r.finish_reason, ref.usage)
    tokens = [t.token for t in r.logprobs.content]
    blocks = check_counters(delta, tokens, EOS, 40)
    assert blocks[-1][1:] == (1, 1), blocks   # EOS is draft 1 of 5 and accepted; nothing after it


@pytest.mark.parametrize("stop", [None, ["5000"]])
def test_stream_equals_non_stream(servers, stop):
    plain, spec = servers
    s = spec["zero"]
    kw = dict(prompt=COUNT_PROMPT, max_tokens=40, stop=stop)
    ref = completion(plain, **kw)
    whole = completion(s, **kw)
    text, usage, finish, chunk_tokens = "", None, None, []
    for ch in completion(s, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.text
            if c.logprobs is not None and c.logprobs.tokens:
                chunk_tokens.append(len(c.logprobs.tokens))
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert (whole.choices[0].text, whole.usage) == (ref.choices[0].text, ref.usage)
    assert (text, finish, usage) == (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage)
    assert sum(chunk_tokens) == usage.completion_tokens
    if stop is None:   # "4" + 5 accepted zeros + the bonus zero arrive in one step: one chunk of >= 6 tokens
        assert max(chunk_tokens) >= K + 1, chunk_tokens
    # chat: EOS ends the stream after an accepted block
    ckw = dict(messages=SHOTS + [{"role": "user", "content": "Write forty thousand in digits."}], max_tokens=40)
    cref = chat(s, **ckw)
    ctext, cusage = "", None
    for ch in s.client().chat.completions.create(model="m", temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, **ckw):
        if ch.usage is not None:
            cusage = ch.usage
        for c in ch.choices:
            ctext += c.delta.content or ""
    assert (ctext, cusage) == (cref.choices[0].message.content, cref.usage)


def test_n2_with_speculation(servers):
    plain, spec = servers
    kw = dict(prompt=COUNT_PROMPT, max_tokens=24)
    ref = completion(plain, **kw)
    got, delta = spec_delta(spec["zero"], lambda: completion(spec["zero"], n=2, **kw))
    assert [c.text for c in got.choices] == [ref.choices[0].text] * 2
    assert got.usage.completion_tokens == 2 * ref.usage.completion_tokens
    d, dt, acc, per, _ = simulate(ref.choices[0].logprobs.tokens, ZERO, 24)
    assert delta == (2 * d, 2 * dt, 2 * acc, [2 * p for p in per]), delta


def test_metrics_invariants(servers):
    _, spec = servers
    for name in ("zero", "eos"):
        d, dt, acc, per = spec[name].spec()
        assert d > 0 and acc <= dt <= K * d, (name, d, dt, acc)
        assert all(per[i + 1] <= per[i] for i in range(K - 1)), per
        assert sum(per) == acc, (per, acc)
        assert per[K - 1] > 0 if name == "zero" else True   # full blocks happened


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
