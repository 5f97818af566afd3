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
    experts it holds; /metrics has a read-bytes figure per rank, the same for all 4 (that a rank at EP reads
    fewer bytes than at TP, keeping the same, is loader_load_rank's check: model_plan_rank_bytes).
  - corrupt checkpoints at EP 4 (review5): wide8 with layer 2's expert 13 missing (only rank 3 reads it),
    with expert 5's gate_proj packed shape lying (same bytes, rank 1), with expert 6's down_proj weight_shape
    value lying (rank 1): `specd serve` exits 1 within 60 s naming the tensor, and no process of that model
    is left behind (the other ranks loaded fine and must be taken down by the failing rank's abort).
The speculative half (EP 4 with the head == EP 4 without) is kimi_c_spec_server_ep4 (test_spec_server.py
with KIMI_C_SERVE_ARGS). Needs $SPECD_BUILD_DIR/server/specd and the miniature with the tokenizer
(KIMI_C_MINI_DIR); exits 77 without them.
"""
import os
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

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


def st_rewrite(path, edit):
    """Rewrites the safetensors file PATH: edit(header dict, data bytes) -> data bytes (header edited in place)."""
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    h, data = json.loads(b[8:8 + n]), b[8 + n:]
    data = edit(h, data)
    hb = json.dumps(h).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def corrupt_copy(root, name, shard, edit, index_edit=None):
    """wide8 under ROOT/NAME: SHARD copied and rewritten by EDIT, everything else linked."""
    d = os.path.join(root, name)
    os.makedirs(d)
    for f in os.listdir(WIDE):
        if f == shard:
            shutil.copy(os.path.join(WIDE, f), d)
        elif f == "model.safetensors.index.json" and index_edit:
            with open(os.path.join(WIDE, f)) as fi:
                idx = json.load(fi)
            index_edit(idx["weight_map"])
            with open(os.path.join(d, f), "w") as fo:
                json.dump(idx, fo)
        else:
            os.symlink(os.path.join(WIDE, f), os.path.join(d, f))
    st_rewrite(os.path.join(d, shard), edit)
    return d


def model_procs(model):
    """pids of processes (not this one) whose command line names MODEL."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if model.encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            pass
    return out


def refused_serve_ep4(model, want):
    """`specd serve MODEL` at EP 4 must exit 1 within 60 s naming WANT, leaving no process of MODEL."""
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    cmd = [SPECD, "serve", model, *COMMON, "--tensor-parallel-size", "4", "--enable-expert-parallel", "--port",
           str(port)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    time.sleep(0.5)
    left = model_procs(model)
    for pid in left:  # the ranks of this test's own server, by pid
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert p.returncode == 1, f"{model} at EP 4 must exit 1, got {p.returncode}: {out[-2000:]}"
    assert all(w in out for w in want), f"{model} at EP 4: want {want} in: {out[-2000:]}"
    assert not left, f"{model} at EP 4: processes left behind: {left}"
    line = [l for l in out.splitlines() if want[0] in l][-1]
    print(f"refused (corrupt, EP 4): {line.strip()[-240:]}")


def check_corrupt(root):
    pre = "language_model.model.layers.2.mlp.experts."
    with open(os.path.join(WIDE, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    sh2 = wm[pre + "13.gate_proj.weight_packed"]  # layer 2's experts: one shard of make_minis.py's layout
    assert all(wm[pre + f"{e}.gate_proj.weight_packed"] == sh2 for e in range(16)), "layer 2's experts split"

    def rename13(m):  # expert 13's tensors renamed to 16 (past E: never read), so 13 is missing, no hole
        for k in [k for k in m if k.startswith(pre + "13.")]:
            m[k.replace(".experts.13.", ".experts.16.")] = m.pop(k)

    def missing(h, data):
        rename13(h)
        return data

    def lie_shape(h, data):
        h[pre + "5.gate_proj.weight_packed"]["shape"] = [128, 32]  # [256, 16]: the same bytes
        return data

    def lie_value(h, data):
        a, b = h[pre + "6.down_proj.weight_shape"]["data_offsets"]
        out_f, in_f = struct.unpack("<2i", data[a:b])
        return data[:a] + struct.pack("<2i", out_f, in_f // 2) + data[b:]

    refused_serve_ep4(corrupt_copy(root, "missing13", sh2, missing, rename13),
                      ["rank 3", pre + "13.gate_proj.weight missing"])
    refused_serve_ep4(corrupt_copy(root, "shape5", sh2, lie_shape), ["rank 1", pre + "5.gate_proj.weight_packed"])
    refused_serve_ep4(corrupt_copy(root, "value6", sh2, lie_value), ["rank 1", pre + "6.down_proj.weight_shape"])


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
    root = tempfile.mkdtemp(prefix="specd_ep_corrupt_")
    try:
        check_corrupt(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

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
