#!/usr/bin/env python3
"""Held-out acceptance of an EAGLE-3 head, measured on the real server.

For each k: starts `specd serve MODEL --draft HEAD --num-speculative-tokens k`,
sends the first N questions of a prompt set as chat requests (greedy,
--max-tokens), and reads the spec-decode counters from /metrics:
acceptance length = 1 + accepted / drafts, per-position acceptance =
accepted_per_pos[i] / drafts. k = 0 is the plain baseline (output tok/s).
Time split (server-side, engine thread): target forward ms per engine step
(prefill steps included: amortised); with drafts, target forward ms per
verify step, draft ms per verify step for proposing the k drafts, and the
draft model's whole time (propose + extend, prompts included) per verify
step. mean_tpot_ms / mean_ttft_ms (server histograms): decode-only and
prefill-side latency per request; at concurrency 1 the TPOT ratio is the
decode-only speed-up, output_tok_s the end-to-end one (prefill included).
--draft-quantization q8_0 serves the head re-quantized, --speculative-token-map
MAP with a hot draft vocabulary (serve flags).
Stdlib only.

Usage: eval_acceptance.py --head DIR [--model GGUF] [--set gsm8k_test|mt_bench] [--n 200]
         [--ks 0,1,2,3,4,5] [--max-tokens 128] [--concurrency 1] [--out results.json]
"""
import argparse, concurrent.futures as cf, json, os, re, signal, socket, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def questions(name, n):
    path = os.path.join(ROOT, "../shared/data/prompts", name + ".jsonl")
    out = []
    with open(path) as f:
        for line in f:
            o = json.loads(line)
            out.append(o["question"] if "question" in o else o["turns"][0])
            if len(out) >= n:
                break
    return out


def metrics(base):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    m, pos = {}, {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        g = re.match(r'specd_spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)', line)
        if g:
            pos[int(g.group(1))] = float(g.group(2))
            continue
        k, _, v = line.partition(" ")
        try:
            m[k] = float(v)
        except ValueError:
            pass
    return m, pos


def chat(base, q, max_tokens):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    r = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=7200) as resp:
        return json.loads(resp.read())["usage"]["completion_tokens"]


def counters(k, m0, m1, p0, p1):
    """Server-side figures between two /metrics snapshots (m, per-position) of a server at k."""
    d = lambda key: m1.get(key, 0) - m0.get(key, 0)
    drafts, dtoks, acc = (d("specd_spec_decode_num_drafts_total"), d("specd_spec_decode_num_draft_tokens_total"),
                          d("specd_spec_decode_num_accepted_tokens_total"))
    r = {}
    # mean time per output token after the first (server-side, per request; TTFT = prefill + queue excluded)
    n_tpot = d("specd_time_per_output_token_seconds_count")
    if n_tpot > 0:
        r["mean_tpot_ms"] = round(1e3 * d("specd_time_per_output_token_seconds_sum") / n_tpot, 2)
        r["mean_ttft_ms"] = round(1e3 * d("specd_time_to_first_token_seconds_sum") /
                                  max(1, d("specd_time_to_first_token_seconds_count")), 1)
    steps, fwd = d("specd_engine_steps_total"), d("specd_model_forward_seconds_total")
    vsteps = d("specd_spec_decode_verify_steps_total")
    if steps > 0:  # time split: mean target forward per engine step; with drafts, per verify step
        r["forward_ms_per_step"] = round(1e3 * fwd / steps, 2)
    if vsteps > 0:
        r["verify_forward_ms_per_step"] = round(1e3 * d("specd_spec_decode_verify_forward_seconds_total") / vsteps, 2)
        r["draft_propose_ms_per_step"] = round(1e3 * d("specd_spec_decode_draft_propose_seconds_total") / vsteps, 2)
        # amortised: the draft's extend over prompts and accepted tokens, per verify step
        r["draft_all_ms_per_step"] = round(1e3 * d("specd_spec_decode_draft_seconds_total") / vsteps, 2)
    if k > 0 and drafts > 0:
        r.update({"drafts": drafts, "draft_tokens": dtoks, "accepted": acc,
                  "acceptance_length": round(1 + acc / drafts, 3), "acceptance_rate": round(acc / dtoks, 3),
                  "per_position": [round((p1.get(i, 0) - p0.get(i, 0)) / drafts, 3) for i in range(k)]})
    return r


def server_args(ap, n, ks, threads):
    """The flags shared with bench_batch1.py: head, model, binary, prompt set, ks, serve flags."""
    ap.add_argument("--head", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/server/specd"))
    ap.add_argument("--set", default="gsm8k_test")
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--ks", default=ks)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out")
    ap.add_argument("--draft-quantization", default="none", choices=["none", "q8_0"],
                    help="passed to specd serve with the draft (k > 0)")
    ap.add_argument("--speculative-token-map", help="passed to specd serve with the draft (k > 0): hot draft vocabulary")
    ap.add_argument("--no-adaptive", action="store_true",
                    help="serve with --no-speculative-adaptive: every verify step drafts exactly k (the acceptance "
                         "length AT k; adaptive speculation, the server's default, may draft fewer or none)")


def server_cmd(a, k, port):
    """`specd serve` for k (0 = no draft) on PORT, with the flags of server_args."""
    cmd = [a.binary, "serve", a.model, "--port", str(port), "--served-model-name", "m",
           "--threads", str(a.threads), "--kv-cache-memory", "512M"]
    if k > 0:
        cmd += ["--draft", a.head, "--num-speculative-tokens", str(k), "--draft-quantization", a.draft_quantization]
        if a.speculative_token_map:
            cmd += ["--speculative-token-map", a.speculative_token_map]
        if a.no_adaptive:
            cmd += ["--no-speculative-adaptive"]
    return cmd


def main():
    ap = argparse.ArgumentParser()
    server_args(ap, 200, "0,1,2,3,4,5", 0)
    ap.add_argument("--concurrency", type=int, default=1)
    a = ap.parse_args()
    qs = questions(a.set, a.n)
    results = []
    for k in [int(x) for x in a.ks.split(",")]:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        srv = subprocess.Popen(server_cmd(a, k, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                try:
                    if urllib.request.urlopen(base + "/health").status == 200:
                        break
                except Exception:
                    time.sleep(0.5)
            m0, p0 = metrics(base)
            t0 = time.time()
            with cf.ThreadPoolExecutor(a.concurrency) as ex:
                toks = sum(ex.map(lambda q: chat(base, q, a.max_tokens), qs))
            dt = time.time() - t0
            time.sleep(0.3)  # the last request's latency histograms are recorded just after its response
            m1, p1 = metrics(base)
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(120)
        r = {"k": k, "requests": len(qs), "completion_tokens": toks, "seconds": round(dt, 2),
             "output_tok_s": round(toks / dt, 2), **counters(k, m0, m1, p0, p1)}
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"set": a.set, "n": a.n, "max_tokens": a.max_tokens, "head": a.head, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
