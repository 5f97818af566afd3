"""soak.py: load and soak test of `specd serve` with speculation (issue 10).

Starts `specd serve` on the SmolLM2 GGUF with an EAGLE-3 head (the committed
draft/heads/smollm2-135m-eagle3 when present, else a random one from
tools/eagle3/make_random_head.py --layout speculators --seed 1; or --draft DIR)
and prefix caching, then runs CLIENTS concurrent client threads for DURATION
seconds. Each client loops over random requests (seeded per client):
  - /v1/completions (80 %) or /v1/chat/completions, streaming (85 %) or not;
  - n in {1, 1, 1, 2, 3}, max_tokens 1..48, temperature 0 or 0.8 (+ seed),
    ignore_eos sometimes, 0-2 random stop strings;
  - 15 % of streams hang up after a random number of events (client disconnect).
Half-way through, a BURST of 2 * (max-num-seqs + max-waiting) requests is
sent at once: the queue bound (--max-waiting) must answer the excess with
429 + Retry-After.

Every request is classified: completed (a 200 with a finish_reason on every
choice, [DONE] last for streams), disconnected (by us), rejected_429 (with a
Retry-After header and an OpenAI error body), rejected_503_queue (waited in
the queue past the server's --max-queue-time, default 120 s here: a 503 with
an OpenAI error body, or that error as a stream's first event): all
documented outcomes.
Anything else (another status, a broken stream, a connection error we did
not cause, a stop string inside the returned text, usage over the limit) is
counted under its kind and fails the run.

At the end: the server is still alive; after it goes idle /metrics shows
specd_kv_blocks_free == total and specd_draft_kv_blocks_free == total,
nothing running or waiting; /health 200; VmRSS (sampled from /proc every 2 s)
after warm-up (the first WARMUP fraction of the run) grows by less than
max(16 MiB, 3 %). A JSON report is printed (and written to --report).

Usage: python tests/reliability/soak.py [--duration S] [--clients N] [--draft DIR] [--report FILE]
ctest (reliability_soak_short): --duration 150 --clients 16. The long run:
tools/soak.sh (64 clients, 30 minutes). Exit 77 = skipped (no binary / model).
"""
import argparse
import http.client
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relutil as R  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the twentieth century are",
    "Explain how a bicycle works:",
    "List of prime numbers: 2, 3, 5, 7,",
    "def fibonacci(n):\n",
    "The weather today is",
    "Question: What is the capital of Italy?\nAnswer:",
    "Write a haiku about autumn leaves.",
    "In 1969, the first humans",
    "A recipe for pancakes: first,",
]
STOPS = [" the", ".", "\n", "ing", "!!", ",", " and", "\n\n"]


class Stats:
    def __init__(self):
        self.mu = threading.Lock()
        self.c = Counter()
        self.examples = {}
        self.tokens = 0

    def add(self, kind, detail=None, tokens=0):
        with self.mu:
            self.c[kind] += 1
            self.tokens += tokens
            if detail and kind not in self.examples:
                self.examples[kind] = str(detail)[:400]


DOCUMENTED = {"completed", "disconnected", "rejected_429", "rejected_503_queue"}


def make_request(rng):
    chat = rng.random() < 0.2
    body = {"model": "smollm2", "max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        body["seed"] = rng.randint(0, 1 << 30)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    stops = rng.sample(STOPS, rng.choice([0, 0, 1, 2]))
    if stops:
        body["stop"] = stops
    prompt = rng.choice(PROMPTS) + ("" if rng.random() < 0.5 else f" (#{rng.randint(0, 999)})")
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["stream"] = rng.random() < 0.85
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    hang_after = rng.randint(0, 6) if body["stream"] and rng.random() < 0.15 else None
    return path, body, stops, hang_after


def check_choices(texts, finishes, body, stops, usage, st, stats):
    n = body["n"]
    if len(texts) != n or any(f not in ("stop", "length") for f in finishes.values()) or len(finishes) != n:
        stats.add("bad_choices", f"{len(texts)} texts, finishes {finishes}, n {n}")
        return False
    for t in texts.values():
        for s in stops:
            if s in t:
                stats.add("stop_string_leaked", f"{s!r} in {t!r}")
                return False
    if usage is not None and usage.get("completion_tokens", 0) > n * body["max_tokens"]:
        stats.add("usage_over_limit", f"{usage} for n {n} max_tokens {body['max_tokens']}")
        return False
    return True


def one_request(port, path, body, stops, hang_after, stats, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status == 429:
            data = r.read()
            ok = r.getheader("Retry-After") is not None and json.loads(data)["error"]["message"]
            stats.add("rejected_429" if ok else "bad_429", data)
            return float(r.getheader("Retry-After") or 1)
        if r.status != 200:
            data = r.read()
            if r.status == 503 and "--max-queue-time" in json.loads(data)["error"]["message"]:
                stats.add("rejected_503_queue", data)  # waited past --max-queue-time: retry later
                return 1.0
            stats.add(f"http_{r.status}", data)
            return
        chat = "chat" in path
        if not body["stream"]:
            out = json.loads(r.read())
            texts = {c["index"]: (c["message"]["content"] if chat else c["text"]) or "" for c in out["choices"]}
            finishes = {c["index"]: c["finish_reason"] for c in out["choices"]}
            if check_choices(texts, finishes, body, stops, out.get("usage"), 200, stats):
                stats.add("completed", tokens=out["usage"]["completion_tokens"])
            return
        texts, finishes, usage, events, done, buf = {}, {}, None, 0, False, b""
        while not done:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf and not done:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    d = line[6:]
                    if d == b"[DONE]":
                        done = True
                        break
                    o = json.loads(d)
                    if "error" in o:
                        # the queue time limit ends sequences that never started; with n > 1 the
                        # request's other choices may have streamed tokens already (each choice is
                        # a sequence), so the documented message is what identifies it
                        queued = "--max-queue-time" in str(o["error"].get("message", ""))
                        stats.add("rejected_503_queue" if queued else "stream_error", o)
                        return 1.0 if queued else None
                    events += 1
                    if o.get("usage"):
                        usage = o["usage"]
                    for c in o["choices"]:
                        piece = (c.get("delta", {}).get("content") if chat else c.get("text")) or ""
                        texts[c["index"]] = texts.get(c["index"], "") + piece
                        if c.get("finish_reason"):
                            finishes[c["index"]] = c["finish_reason"]
                if hang_after is not None and events >= hang_after:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    stats.add("disconnected")
                    return
        if not done:
            stats.add("stream_truncated", f"{events} events, no [DONE]")
            return
        for i in range(body["n"]):
            texts.setdefault(i, "")
        if check_choices(texts, finishes, body, stops, usage, 200, stats):
            stats.add("completed", tokens=(usage or {}).get("completion_tokens", 0))
    except (OSError, http.client.HTTPException, ValueError) as e:
        stats.add("client_error_" + type(e).__name__, e)
    finally:
        conn.close()


def client_loop(port, seed, deadline, stats):
    rng = random.Random(seed)
    while time.time() < deadline:
        path, body, stops, hang_after = make_request(rng)
        retry_after = one_request(port, path, body, stops, hang_after, stats)
        if retry_after:  # a well-behaved client honours Retry-After
            time.sleep(min(retry_after, max(0.0, deadline - time.time())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=150)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--draft", default=None,
                    help="EAGLE-3 head dir (default: draft/heads/smollm2-135m-eagle3 when committed, else a random "
                         "head, seed 1); 'random' forces the random head")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-waiting", type=int, default=24)
    ap.add_argument("--max-queue-time", type=float, default=120,
                    help="server --max-queue-time: past it a queued request gets 503 (a documented outcome)")
    ap.add_argument("--kv-cache-memory", default="24M")
    ap.add_argument("--warmup", type=float, default=0.25,
                    help="least fraction of the run before RSS is tracked (see the sampler)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--report", default=None)
    a = ap.parse_args()
    if not R.have_binary_and_model():
        print(f"skip: need {R.SPECD} and {R.MODEL}")
        return 77
    tmp = tempfile.mkdtemp(prefix="specd_soak_")
    trained = os.path.join(R.SRC, "draft/heads/smollm2-135m-eagle3")
    if a.draft is None and os.path.exists(os.path.join(trained, "model.safetensors")):
        a.draft = trained
    head = a.draft if a.draft not in (None, "random") else R.make_random_head(os.path.join(tmp, "head"), seed=1)
    print(f"soak: draft {head}", flush=True)
    srv = R.Server(R.MODEL, ["--served-model-name", "smollm2", "--draft", head, "--num-speculative-tokens", "3",
                             "--enable-prefix-caching", "--max-model-len", "512",
                             "--kv-cache-memory", a.kv_cache_memory, "--max-num-seqs", str(a.max_num_seqs),
                             "--max-waiting", str(a.max_waiting), "--max-queue-time", str(a.max_queue_time),
                             "--connection-timeout", "60",
                             "--shutdown-timeout", "30"], threads=a.threads)
    stats = Stats()
    rss = []  # (t, KiB)
    t0 = time.time()
    deadline = t0 + a.duration
    stop_sampler = threading.Event()

    warm_at = [None]  # seconds into the run when the warm-up ended

    def sampler():
        # Warm-up ends when the KV pool has certainly been cycled (its pages are touched lazily: the LRU free
        # queue hands out never-used blocks first, so 2x the pool's tokens allocated touches every block) and
        # the WARMUP fraction of the run has passed.
        while not stop_sampler.is_set():
            if srv.proc.poll() is None:
                t = time.time() - t0
                rss.append((t, srv.rss_kib()))
                if warm_at[0] is None and t >= a.warmup * a.duration:
                    try:
                        mm = srv.metrics()
                        used = mm["specd_prompt_tokens_total"] + mm["specd_generation_tokens_total"]
                        if used >= 2 * 16 * mm["specd_kv_blocks_total"]:
                            warm_at[0] = t
                    except (OSError, KeyError, AssertionError):
                        pass
            stop_sampler.wait(2.0)

    ths = [threading.Thread(target=sampler)]
    ths += [threading.Thread(target=client_loop, args=(srv.port, a.seed * 1000 + i, deadline, stats))
            for i in range(a.clients)]
    for t in ths:
        t.start()
    # the burst over the queue bound, half-way
    time.sleep(a.duration / 2)
    burst_n = 2 * (a.max_num_seqs + a.max_waiting)
    bstats = Stats()
    rng = random.Random(a.seed)
    burst = [threading.Thread(target=one_request, args=(srv.port, "/v1/completions",
                                                        {"model": "smollm2", "prompt": rng.choice(PROMPTS),
                                                         "max_tokens": 16, "temperature": 0, "n": 1,
                                                         "ignore_eos": True, "stream": False}, [], None, bstats))
             for _ in range(burst_n)]
    for t in burst:
        t.start()
    for t in burst:
        t.join()
    for t in ths[1:]:
        t.join()
    alive = srv.proc.poll() is None
    m = srv.wait_idle(timeout=300) if alive else {}
    health = srv.raw("GET", "/health")[0] if alive else None
    stop_sampler.set()
    ths[0].join()
    rc_stop = srv.stop()
    wall = time.time() - t0
    warm = [kib for t, kib in rss if warm_at[0] is not None and t >= warm_at[0]]
    rss_start, rss_end = (warm[0], warm[-1]) if warm else (-1, -1)
    rss_max = max(warm) if warm else -1
    limit_kib = max(16 * 1024, int(0.03 * rss_start))
    report = {
        "duration_s": a.duration, "clients": a.clients, "wall_s": round(wall, 1),
        "requests": sum(stats.c.values()), "outcomes": dict(stats.c), "tokens": stats.tokens,
        "burst": {"sent": burst_n, "outcomes": dict(bstats.c)},
        "error_examples": {k: v for k, v in {**stats.examples, **bstats.examples}.items() if k not in DOCUMENTED},
        "rss_kib": {"after_warmup": rss_start, "end": rss_end, "max_after_warmup": rss_max,
                    "first": rss[0][1] if rss else -1, "limit_growth": limit_kib,
                    "warmup_end_s": warm_at[0], "samples_t_s_kib": " ".join(f"{t:.0f}:{k}" for t, k in rss[::max(1, len(rss) // 20)])},
        "kv_blocks": {"free": m.get("specd_kv_blocks_free"), "total": m.get("specd_kv_blocks_total")},
        "draft_kv_blocks": {"free": m.get("specd_draft_kv_blocks_free"), "total": m.get("specd_draft_kv_blocks_total")},
        "spec": {k: m.get(f"specd_spec_decode_{k}_total") for k in ("num_drafts", "num_draft_tokens",
                                                                    "num_accepted_tokens")},
        "preemptions": m.get("specd_num_preemptions_total"),
        "health": health, "server_alive_at_end": alive, "server_exit_code": rc_stop,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    fails = []
    if not alive:
        fails.append("server died: " + srv.read_log(2000))
    bad = {k: v for k, v in {**stats.c, **bstats.c}.items() if k not in DOCUMENTED}
    if bad:
        fails.append(f"undocumented outcomes {bad}")
    if stats.c["completed"] == 0:
        fails.append("no request completed")
    if bstats.c["rejected_429"] == 0:
        fails.append("the burst over --max-waiting got no 429")
    if alive and (m["specd_kv_blocks_free"] != m["specd_kv_blocks_total"]
                  or m["specd_draft_kv_blocks_free"] != m["specd_draft_kv_blocks_total"]
                  or m["specd_num_requests_running"] or m["specd_num_requests_waiting"]):
        fails.append("KV blocks not all free / requests left")
    if health != 200:
        fails.append(f"/health {health}")
    if rc_stop != 0:
        fails.append(f"exit code {rc_stop} after SIGTERM")
    if not warm:
        print("soak: warning: the warm-up (2x the KV pool's tokens) did not end: RSS flatness not checked")
    elif len(warm) < 3:
        print("soak: warning: fewer than 3 RSS samples after warm-up: RSS flatness not checked")
    elif rss_max - rss_start > limit_kib:
        fails.append(f"RSS grew {rss_max - rss_start} KiB after warm-up (limit {limit_kib})")
    for f in fails:
        print("soak: FAIL:", f)
    print("soak:", "FAIL" if fails else "ok")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
