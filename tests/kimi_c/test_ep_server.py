#!/usr/bin/env python3
"""test_ep_server.py (kimi_c_ep_server): `specd serve --enable-expert-parallel` on the Kimi miniature.

  - refusals, each a non-zero exit naming the reason (with --check-config, and a real start for the first
    two: no rank is started for a refused combination): the flag at --tensor-parallel-size 1; at 3 on k25
    (3 does not divide its 16 routed experts); on a GGUF (SmolLM2, dense); on a dense HF Llama (model_hf
    mini); k25 at EP 2 passes --check-config;
  - served: the 8-head miniature "wide8" at --tensor-parallel-size 4 --enable-expert-parallel (4 rank
    processes, 4 of the 16 experts whole on each) against the same model served at TP 1: 4 chat requests
    (test_spec_server.py's first four), temperature 0, 20 tokens, sent one at a time and then concurrently:
    text, finish reason and usage identical (kimi_c_ep bounds the logits of EP vs TP 1 at 1e-5 of
    max|logit|, measured ~1e-6, far below the miniature's greedy margins); each rank's log says which
    experts it holds; /metrics' per-rank read bytes below TP 4's would be (what loader_load_bytes counts).
The speculative half (EP 4 with the head == EP 4 without) is kimi_c_spec_server_ep4 (test_spec_server.py
with KIMI_C_SERVE_ARGS). Needs $SPECD_BUILD_DIR/server/specd and the miniature with the tokenizer
(KIMI_C_MINI_DIR); exits 77 without them.
"""
import os
import re
import socket
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_spec_server as ss  # noqa: E402  (Server, ask, CONVS)

SPECD, MINI = ss.SPECD, ss.MINI
K25, WIDE = os.path.join(MINI, "k25"), os.path.join(MINI, "wide8")
GGUF = os.path.join(os.environ.get("SPECD_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE))), "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
HF = os.path.join(os.environ.get("MODEL_HF_MINI_DIR", ""), "f32")
COMMON = ["--served-model-name", "kimi-mini", "--max-model-len", "256", "--kv-cache-memory", "32M", "--threads", "1",
          "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--device", "cpu"]


def refused(model, args, want, check_config=True):
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    cmd = [SPECD, "serve", model, *COMMON, *args] + (["--check-config"] if check_config else ["--port", str(port)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"{' '.join(args)} on {model} must be refused: {out[-2000:]}"
    assert all(w in out for w in want), f"{' '.join(args)} on {model}: want {want} in: {out[-2000:]}"
    line = [l for l in out.splitlines() if want[0] in l][-1]
    print(f"refused ({'--check-config' if check_config else 'serve'}): {line.strip()[-240:]}")


def main():
    if not os.path.isfile(SPECD) or not os.path.isfile(os.path.join(WIDE, "tiktoken.model")):
        print("SKIP: no specd binary or no miniature with its tokenizer (kimi_c_mini_setup needs ../shared/data)")
        return 77
    for cc in (True, False):
        refused(K25, ["--enable-expert-parallel"], ["--enable-expert-parallel", "--tensor-parallel-size > 1"], cc)
        refused(K25, ["--enable-expert-parallel", "--tensor-parallel-size", "3"],
                ["--tensor-parallel-size 3 does not divide the 16 routed experts"], cc)
    if os.path.isfile(GGUF):
        refused(GGUF, ["--enable-expert-parallel", "--tensor-parallel-size", "2"], ["GGUF", "mixture-of-experts"])
    if os.path.isfile(os.path.join(HF, "config.json")):
        refused(HF, ["--enable-expert-parallel", "--tensor-parallel-size", "2"], ["no routed experts", "dense"])
    p = subprocess.run([SPECD, "serve", K25, *COMMON, "--enable-expert-parallel", "--tensor-parallel-size", "2",
                        "--check-config"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"k25 at EP 2 must pass --check-config: {(p.stdout + p.stderr)[-2000:]}"

    convs = ss.CONVS[:4]
    ref = ss.Server(WIDE, COMMON, "tp1")
    try:
        want = [ss.ask(ref, c) for c in convs]
    finally:
        ref.stop()
    ep = ss.Server(WIDE, [*COMMON, "--tensor-parallel-size", "4", "--enable-expert-parallel"], "ep4")
    try:
        alone = [ss.ask(ep, c) for c in convs]
        together = [None] * len(convs)

        def one(i):
            together[i] = ss.ask(ep, convs[i])

        th = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
        for t in th:
            t.start()
        for t in th:
            t.join()
        m = ss.parse_metrics(ep.raw("GET", "/metrics")[1].decode())
        log = ep.read_log()
    finally:
        rc = ep.stop()
    assert rc == 0, f"EP 4 server exit {rc}"
    for i, (a, b, c) in enumerate(zip(want, alone, together)):
        assert a == b, f"request {i}: EP 4 alone {b} != TP 1 {a}"
        assert a == c, f"request {i}: EP 4 concurrent {c} != TP 1 {a}"
    held = sorted(set(re.findall(r"routed experts (\d+)\.\.(\d+) of 16 whole \(expert parallel\)", log)))
    # the log keeps its last 4000 characters: at least rank 0's line must be there
    assert held, f"no rank says which experts it holds: {log[-2000:]}"
    reads = {k: v for k, v in m.items() if k.startswith("specd_rank_load_read_bytes")}
    assert len(reads) == 4 and len(set(reads.values())) == 1, f"per-rank read bytes: {reads}"
    print(f"wide8 EP 4 served: {len(convs)} requests alone and concurrent == TP 1 (text, finish, usage); experts held "
          f"{held}; each rank read {int(next(iter(reads.values())))} bytes of the checkpoint")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
