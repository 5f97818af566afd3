#!/usr/bin/env python3
"""Batch-1 speed-up of speculative decoding on the real server, paired.

Issue 6 asks for "batch 1, same server, speculation on vs off: output tok/s
ratio for the best k". On a shared 2-vCPU machine the speed drifts by 10-20%
within minutes, so running one configuration after the other mostly measures
the drift. This tool starts one `specd serve` per configuration at once (the
same binary, model, threads and flags; k = 0 is plain decoding) and sends
every question to each server in turn, one request at a time, so each
configuration sees the same prompts at nearly the same moment. Idle servers
sleep (the CPU thread pool spins ~20 us, then waits on a condition variable),
so only the server answering uses the cores.

Per configuration: output tok/s = completion tokens / summed request wall
time (end to end: prefill included), the server's mean TPOT (decode only,
/metrics histogram) and TTFT, the spec counters (acceptance length, per
position) and the time split per verify step (target forward, draft
propose). Ratios are against k = 0, per round and pooled over rounds.

Configurations (--ks): "0" is plain decoding; "K" is speculation with at most K drafts per step in the
server's default mode (adaptive: k in 0..K chosen per sequence and step, docs/draft.md); "Kf" is fixed k = K
(--no-speculative-adaptive). Each configuration also reports the chosen-k distribution of its decode steps
(specd_spec_decode_chosen_k_total), as fractions.

Stdlib only; reuses eval_acceptance.py's helpers.

Usage: bench_batch1.py --head DIR [--binary build/server/specd] [--set gsm8k_test] [--n 16]
         [--ks 0,1,2,3] [--rounds 2] [--max-tokens 128] [--threads 2]
         [--speculative-token-map MAP] [--draft-quantization none|q8_0] [--out results.json]
"""
import argparse, json, os, signal, subprocess, sys, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_acceptance import chat, counters, free_port, metrics, questions, server_args, server_cmd  # noqa: E402


def kval(label):
    """The draft count of a --ks label ("3" adaptive, "3f" fixed, "0" plain)."""
    return int(label[:-1]) if label.endswith("f") else int(label)


def start(a, label):
    port = free_port()
    cmd = server_cmd(a, kval(label), port) + (["--no-speculative-adaptive"] if label.endswith("f") else [])
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return srv, f"http://127.0.0.1:{port}"


def wait_ready(base, srv):
    for _ in range(600):
        if srv.poll() is not None:
            raise SystemExit(f"server {base} exited with {srv.returncode}")
        try:
            if urllib.request.urlopen(base + "/health").status == 200:
                return
        except Exception:
            time.sleep(0.5)
    raise SystemExit(f"server {base} not ready")


def chosen_k(m0, m1):
    """Fractions of decode steps by the k planned (adaptive speculation's choice), between two snapshots."""
    pre = 'specd_spec_decode_chosen_k_total{k="'
    d = {int(key[len(pre):-2]): m1[key] - m0.get(key, 0) for key in m1 if key.startswith(pre)}
    tot = sum(d.values())
    return {str(k): round(v / tot, 3) for k, v in sorted(d.items())} if tot > 0 else {}


def summarize(label, toks, secs, m0, m1, p0, p1):
    r = {"k": label, "completion_tokens": toks, "seconds": round(secs, 2), "output_tok_s": round(toks / secs, 2),
         **counters(kval(label), m0, m1, p0, p1)}
    if kval(label) > 0:
        r["chosen_k"] = chosen_k(m0, m1)
    return r


def main():
    ap = argparse.ArgumentParser()
    server_args(ap, 16, "0,1,2,3", 2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ks = a.ks.split(",")
    if "0" not in ks or len(set(ks)) != len(ks) or any(not x.rstrip("f").isdigit() for x in ks):
        raise SystemExit("--ks must include 0 (the plain baseline) and name each configuration (K or Kf) once")
    qs = questions(a.set, a.n)
    servers = {}
    rounds = []
    first = snap1 = None
    try:
        for k in ks:
            servers[k] = start(a, k)
        for k, (srv, base) in servers.items():
            wait_ready(base, srv)
            chat(base, "Say hi.", 8)  # warm-up: first-touch page faults, thread start
        for rd in range(a.rounds):
            toks = {k: 0 for k in ks}
            secs = {k: 0.0 for k in ks}
            snap0 = {k: metrics(servers[k][1]) for k in ks}
            first = first if rd else snap0
            for i, q in enumerate(qs):
                order = ks if (i + rd) % 2 == 0 else ks[::-1]  # alternate who goes first
                for k in order:
                    t0 = time.time()
                    toks[k] += chat(servers[k][1], q, a.max_tokens)
                    secs[k] += time.time() - t0
            time.sleep(0.3)  # the last request's latency histograms are recorded just after its response
            snap1 = {k: metrics(servers[k][1]) for k in ks}
            res = [summarize(k, toks[k], secs[k], snap0[k][0], snap1[k][0], snap0[k][1], snap1[k][1]) for k in ks]
            base = next(r for r in res if r["k"] == "0")
            for r in res:
                r["speedup_output_tok_s"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
                if "mean_tpot_ms" in r and "mean_tpot_ms" in base:
                    r["speedup_tpot"] = round(base["mean_tpot_ms"] / r["mean_tpot_ms"], 3)
                print(json.dumps({"round": rd, **r}), flush=True)
            rounds.append(res)
    finally:
        for srv, _ in servers.values():
            srv.send_signal(signal.SIGTERM)
        for srv, _ in servers.values():
            try:
                srv.wait(120)
            except subprocess.TimeoutExpired:
                srv.kill()
    pooled = []
    for j, k in enumerate(ks):
        t = sum(r[j]["completion_tokens"] for r in rounds)
        s = sum(r[j]["seconds"] for r in rounds)
        pooled.append({"k": k, "output_tok_s": round(t / s, 2)})
        if kval(k) > 0 and first and snap1:
            pooled[-1]["chosen_k"] = chosen_k(first[k][0], snap1[k][0])
    for j, k in enumerate(ks):  # decode-only: summed per-round mean TPOTs, baseline over this configuration
        tp = [r[j].get("mean_tpot_ms") for r in rounds]
        tb = [r[ks.index("0")].get("mean_tpot_ms") for r in rounds]
        if all(tp) and all(tb):
            pooled[j]["speedup_tpot"] = round(sum(tb) / sum(tp), 3)
    for p in pooled:
        p["speedup_output_tok_s"] = round(p["output_tok_s"] / pooled[ks.index("0")]["output_tok_s"], 3)
        print(json.dumps({"pooled": True, **p}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"set": a.set, "n": a.n, "max_tokens": a.max_tokens, "threads": a.threads, "head": a.head,
                       "speculative_token_map": a.speculative_token_map, "draft_quantization": a.draft_quantization,
                       "binary": a.binary, "rounds": rounds, "pooled": pooled}, f, indent=1)


if __name__ == "__main__":
    main()
