"""`specd serve --device cuda --tensor-parallel-size N` (issue 18 item "TP on GPUs"): every rank process opens
device rank mod (the GPUs it sees), so K ranks share one GPU.

Without a usable GPU (ctest server_tp_cuda, label unit):
  - `serve SmolLM2 --device cuda --tensor-parallel-size 3` exits non-zero within REFUSE_BOUND_S, its output
    names a rank's reason ("--device cuda: rank R: no usable GPU (device 0): <kn_probe's reason>": rank 0's, or
    a worker's when that one failed first, even before rank 0 saw every worker attach); once it has exited no
    rank process is left (none whose command line carries --specd-comm-parent=<its pid>);
  - one rank's device start failing (fault injection SPECD_FAULT_TP_DEVICE_FAIL=R, with --device cpu so it runs
    here; R = 2, 1, 0) while the others start: non-zero exit within the bound naming rank R's reason, nothing left;
  - `--device cpu --tensor-parallel-size 3 --tp-comm cuda_ipc` refuses with the reason (cuda_ipc needs a GPU
    backend), non-zero, no rank left; `--tp-comm bogus` is refused by the flag parser.
  With a usable GPU this mode exits 77 (the --gpu mode covers it).

With a GPU (`--gpu`, ctest server_tp_cuda_gpu, label gpu; exits 77 here with the reason), on the tiny HF Llama
"f32" (4 heads, 2 KV heads; tools/gen_llama_hf_mini.py, $MODEL_HF_MINI_DIR): a TP 1 server on the GPU, then
TP 2 servers on the same GPU with --tp-comm cuda_ipc (auto) and shm:
  - greedy /v1/completions (32 tokens, 4 prompts, logprobs 2): TP 2 tokens == TP 1 tokens, except after a
    near-tie (TP 1's top-2 gap below TIE_NATS at the first difference: the row-parallel sums differ from TP
    1's in the last bits); the TP 2 logprobs within 1e-3 of TP 1's before any difference;
  - cuda_ipc == shm bit for bit (tokens and every logprob float: the same rank-order f32 additions), and a
    rerun on cuda_ipc identical (deterministic);
  - CUDA graphs at TP 2 (docs/engine.md "CUDA graphs at TP > 1"): the cuda_ipc server captures them on both
    ranks (rank 0's "cuda graphs: N captured" line, no "off on every rank"), the shm server logs them off naming
    shm; so cuda_ipc (graph replays, the cuda_ipc kernels inside the graphs, replayed many times per request)
    == shm (eager) bit for bit above, and a cuda_ipc server with --enforce-eager == the graph one bit for bit;
  - --tp-comm nccl (SPECD_TP_NCCL_HOSTID_PER_RANK=1: each rank its own NCCL_HOSTID, so NCCL < 2.30 accepts two
    ranks of one GPU over loopback sockets; function only): greedy vs TP 1 by the same rule; skipped with a note
    when libnccl is not loadable;
  - chat, stream (the chunks' text == the non-streamed text), n = 2 (both choices == the greedy text) through
    the openai client when it is importable (the GPU machine may only have the system python: then the same
    requests as raw HTTP, said in the output);
  - the start-up log has each rank's "cuda plan" line, /metrics has both ranks' weights and KV bytes (> 0,
    the shard smaller than TP 1's weights);
  - the EAGLE-3 head split across the two GPU ranks (a random head of the mini's shapes, written here with
    tools/eagle3/make_random_head.py: 2 of its 4 heads, 1 of 2 KV heads, half the MLP and of its 256 draft ids
    per rank, the draft logits all-gathered on the devices), k = 3 on cuda_ipc: speculative greedy == plain
    greedy at TP 2, 4 prompts alone and 8 concurrent; drafts made; the log says the head was split.
Run: python tests/server/test_tp_cuda.py [--gpu]
"""
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

GPU = "--gpu" in sys.argv[1:]
MINI = os.path.join(os.environ.get("MODEL_HF_MINI_DIR", os.path.join(sp.BUILD, "model_hf_mini")), "f32")
REFUSE_BOUND_S = 30.0
TIE_NATS = 2e-3
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "def main():"]
MAX_TOK = 32


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def gpu_reason(model):
    """None when `serve MODEL --check-config --device cuda` passes (a usable GPU), else its reason."""
    p = subprocess.run([sp.SPECD, "serve", model, "--check-config", "--device", "cuda"], capture_output=True,
                       text=True, timeout=120)
    if p.returncode == 0:
        return None
    m = re.search(r"no usable GPU: (.*)", p.stdout + p.stderr)
    return m.group(1).strip() if m else (p.stdout + p.stderr).strip()[-300:]


def rank_procs(parent):
    """PIDs of processes whose command line carries --specd-comm-parent=PARENT (its worker ranks)."""
    tag = f"--specd-comm-parent={parent}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if tag in f.read().split(b"\0"):
                    with open(f"/proc/{d}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(d))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def refuses(args, want, model=None, env=None):
    """Starts serve with ARGS; asserts a non-zero exit within REFUSE_BOUND_S naming WANT (a regex) and no rank
    process left. Returns the output."""
    t0 = time.time()
    p = subprocess.Popen([sp.SPECD, "serve", model or sp.MODEL, "--port", str(sp.free_port()), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    try:
        out, _ = p.communicate(timeout=REFUSE_BOUND_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"{args}: still running after {REFUSE_BOUND_S} s (a hang): {out[-2000:]}")
    dt = time.time() - t0
    assert p.returncode != 0, f"{args}: exit {p.returncode}, expected a refusal: {out[-2000:]}"
    assert re.search(want, out), f"{args}: the output must match {want!r}: {out[-3000:]}"
    left = []
    for _ in range(20):  # the workers exit on the group's abort; give them 2 s to be reaped by init
        left = rank_procs(p.pid)
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"{args}: rank processes left behind: {left}"
    print(f"refused in {dt:.2f} s, exit {p.returncode}, no rank left: {re.search(want, out).group(0)[:200]}")
    return out


def main_cpu():
    if not sp.have_specd_and_model():
        skip(f"need {sp.SPECD} and {sp.MODEL}")
    why = gpu_reason(sp.MODEL)
    if why is None:
        skip("a GPU is usable here: server_tp_cuda_gpu (--gpu) runs instead")
    common = ["--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "16M"]
    out = refuses(["--device", "cuda", "--tensor-parallel-size", "3", *common],
                  r"--device cuda: rank \d: no usable GPU \(device 0\): \S.{10,}")
    assert why in out, f"rank 0's reason must be kn_probe's ({why}): {out[-2000:]}"
    for r in (1, 2):  # each worker logs its own reason (unless rank 0's abort reached it first)
        if f"specd worker rank {r}:" not in out:
            print(f"note: worker {r} was stopped by rank 0's abort before logging its own reason")
    # one rank's device fails while the others start (SPECD_FAULT_TP_DEVICE_FAIL=R fails rank R's device start, on
    # the CPU here): the group exits non-zero with that rank's reason, whichever rank it is, and nothing is left
    for r in (2, 1, 0):
        out = refuses(["--device", "cpu", "--tensor-parallel-size", "3", *common],
                      rf"rank {r}: device start failed \(SPECD_FAULT_TP_DEVICE_FAIL\)",
                      env={"SPECD_FAULT_TP_DEVICE_FAIL": str(r)})
        assert "specd serve:" in out, f"rank 0 must report the group's failure: {out[-2000:]}"
    refuses(["--device", "cpu", "--tensor-parallel-size", "3", "--tp-comm", "cuda_ipc", *common],
            r"--tp-comm cuda_ipc needs a GPU backend")
    refuses(["--tensor-parallel-size", "3", "--tp-comm", "bogus", *common], r"--tp-comm must be one of")


def complete(server, prompt, n=1, stream=False):
    st, data, _ = server.raw("POST", "/v1/completions", {"model": "mini", "prompt": prompt, "max_tokens": MAX_TOK,
                                                          "temperature": 0, "logprobs": 2, "ignore_eos": True})
    assert st == 200, (st, data[:500])
    c = json.loads(data)["choices"][0]
    lp = c["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], c["text"]


def compare_tp1(name, ref, got):
    """TP N tokens == TP 1's, except after a near-tie of TP 1's."""
    t1, l1, top1, _ = ref
    t2, l2, _, _ = got
    for i, (a, b) in enumerate(zip(t1, t2)):
        if a != b:
            vals = sorted(top1[i].values(), reverse=True)
            gap = vals[0] - vals[1] if len(vals) > 1 else float("inf")
            assert gap < TIE_NATS, f"{name}: token {i} {b!r} vs TP 1's {a!r} at a top-2 gap of {gap:.3g} nats"
            print(f"{name}: differs from TP 1 at token {i} after a near-tie ({gap:.3g} nats)")
            return
        assert abs(l1[i] - l2[i]) < 1e-3, f"{name}: token {i} logprob {l2[i]} vs TP 1's {l1[i]}"
    assert len(t1) == len(t2) == MAX_TOK, (len(t1), len(t2))


def openai_checks(server, greedy_text):
    """chat, stream, n = 2 through the openai client (or raw HTTP without it)."""
    msgs = [{"role": "user", "content": "Say something."}]
    try:
        client = server.client()
    except ImportError:
        client = None
    if client:
        r = client.chat.completions.create(model="mini", messages=msgs, max_tokens=16, temperature=0)
        chat = r.choices[0].message.content
        s = client.chat.completions.create(model="mini", messages=msgs, max_tokens=16, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        r2 = client.completions.create(model="mini", prompt=PROMPTS[0], max_tokens=MAX_TOK, temperature=0, n=2,
                                       extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(r2.choices, key=lambda c: c.index)]
        how = "openai client"
    else:
        st, chat_obj = server.post("/v1/chat/completions", {"model": "mini", "messages": msgs, "max_tokens": 16,
                                                            "temperature": 0})
        assert st == 200, (st, chat_obj)
        chat = chat_obj["choices"][0]["message"]["content"]
        st, data, _ = server.raw("POST", "/v1/chat/completions", {"model": "mini", "messages": msgs, "max_tokens": 16,
                                                                   "temperature": 0, "stream": True})
        assert st == 200, st
        streamed = ""
        for line in data.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                if ch.get("choices"):
                    streamed += ch["choices"][0]["delta"].get("content") or ""
        st, r2 = server.post("/v1/completions", {"model": "mini", "prompt": PROMPTS[0], "max_tokens": MAX_TOK,
                                                 "temperature": 0, "n": 2, "ignore_eos": True})
        assert st == 200, (st, r2)
        texts = [c["text"] for c in sorted(r2["choices"], key=lambda c: c["index"])]
        how = "raw HTTP (no openai module in this python)"
    assert chat and streamed == chat, (chat, streamed)
    assert texts == [greedy_text, greedy_text], (texts, greedy_text)
    print(f"chat / stream / n=2 via {how}: stream == chat ({len(chat)} chars), both n=2 choices == greedy")


def draft_checks(common, dev, comm):
    """The EAGLE-3 head split across the GPU ranks (draft/eagle3_tp.h eagle3_tp_load) at TP 2 on the mini: a
    random head of the mini's shapes (tools/eagle3/make_random_head.py, numpy only: 4 heads, 2 KV heads, MLP 176,
    256 draft ids, so every rank holds half of it and the draft logits are all-gathered on the devices), k = 3
    (fixed: adaptive speculation would stop drafting a head that accepts nothing):
    speculative greedy == plain greedy at the same TP, alone and 8 concurrent; drafts were made (the random head
    accepts next to nothing: this checks losslessness and the split's wiring, not acceptance)."""
    import concurrent.futures
    import tempfile
    head = tempfile.mkdtemp(prefix="specd_tp_head_")
    subprocess.run([sys.executable, os.path.join(sp.SRC, "tools", "eagle3", "make_random_head.py"), "--layout",
                    "speculators", "--out", head, "--seed", "11", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--inter", "176", "--target-vocab", "512", "--draft-vocab", "256",
                    "--target-layers", "3", "--aux-ids", "0,1,2", "--verifier", MINI], check=True,
                   stdout=subprocess.DEVNULL)
    tp = [*common, "--tensor-parallel-size", "2", "--tp-comm", comm]
    outs = {}
    spec = ["--draft", head, "--num-speculative-tokens", "3", "--no-speculative-adaptive"]
    for name, extra in (("plain", []), ("spec", spec)):
        s = sp.Server([*tp, *extra], model=MINI)
        try:
            alone = [complete(s, p) for p in PROMPTS]
            with concurrent.futures.ThreadPoolExecutor(8) as ex:
                together = list(ex.map(lambda p: complete(s, p), PROMPTS * 2))
            outs[name] = ([(a[0], a[3]) for a in alone], [(a[0], a[3]) for a in together])
            if name == "spec":
                m = s.metrics()
                drafts = m.get("specd_spec_decode_num_drafts_total") or 0
                assert drafts > 0, f"no drafts made ({drafts})"
                log = s.read_log(200000)
                if dev == "cuda":
                    assert "draft head split across the 2 GPU ranks" in log, "the head was not split across the ranks"
                print(f"TP 2 {comm} with the split head, k = 3: {drafts:.0f} drafts, "
                      f"{m.get('specd_spec_decode_num_accepted_tokens_total') or 0:.0f} draft tokens accepted")
        finally:
            rc = s.stop()
        assert rc == 0, f"TP 2 {comm} {name}: exit {rc}"
    assert outs["spec"][0] == outs["plain"][0], "speculative greedy differs from plain greedy (alone)"
    assert outs["spec"][1] == outs["plain"][1], "speculative greedy differs from plain greedy (8 concurrent)"
    assert outs["plain"][1][:len(PROMPTS)] == outs["plain"][0], "plain greedy: 8 concurrent differ from alone"
    print(f"TP 2 {comm}, EAGLE-3 head split across the ranks: speculative greedy == plain greedy, {len(PROMPTS)} "
          f"prompts alone and 8 concurrent")


def main_gpu():
    if not os.access(sp.SPECD, os.X_OK):
        skip(f"need {sp.SPECD}")
    if not os.path.exists(os.path.join(MINI, "tokenizer.json")):
        skip(f"need {MINI} (tools/gen_llama_hf_mini.py)")
    # SPECD_TP_TEST_DEVICE=cpu: a dry run of this script's logic on the CPU (shm only)
    dev = os.environ.get("SPECD_TP_TEST_DEVICE", "cuda")
    why = gpu_reason(MINI) if dev == "cuda" else None
    if why is not None:
        skip(f"no usable GPU: {why}")
    comms = ("cuda_ipc", "shm") if dev == "cuda" else ("shm", "auto")
    common = ["--device", dev, "--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--threads", "1",
              "--served-model-name", "mini", "--max-num-seqs", "8"]
    s1 = sp.Server(common, model=MINI)
    try:
        ref = [complete(s1, p) for p in PROMPTS]
        w1 = s1.metrics().get('specd_rank_weight_bytes{rank="0"}')
    finally:
        s1.stop()
    res = {}
    for comm in comms:
        s = sp.Server([*common, "--tensor-parallel-size", "2", "--tp-comm", comm], model=MINI)
        try:
            got = [complete(s, p) for p in PROMPTS]
            for i, g in enumerate(got):
                compare_tp1(f"TP 2 {comm} prompt {i}", ref[i], g)
            if comm == comms[0]:
                again = [complete(s, p) for p in PROMPTS]
                assert again == got, f"TP 2 {comm}: a rerun differs (not deterministic)"
                openai_checks(s, got[0][3])
                m = s.metrics()
                for r in (0, 1):
                    wb, kv = m.get(f'specd_rank_weight_bytes{{rank="{r}"}}'), m.get(f'specd_rank_kv_cache_bytes{{rank="{r}"}}')
                    assert wb and kv and wb > 0 and kv > 0, (r, wb, kv)
                    assert not w1 or wb < w1, f"rank {r} weights {wb} not below TP 1's {w1}"
                log = s.read_log(200000)
                for r in (0, 1) if dev == "cuda" else ():
                    assert re.search(rf"rank {r}/2 on GPU \d+ .*cuda plan:", log), f"no cuda plan line of rank {r}"
            if dev == "cuda":
                log = s.read_log(200000)
                if comm == "cuda_ipc":
                    assert re.search(r"cuda graphs: \d+ captured", log) and "off on every rank" not in log, \
                        "TP 2 cuda_ipc: no CUDA graphs captured on both ranks"
                else:
                    assert "with --tp-comm shm" in log, "TP 2 shm: no 'graphs off with shm' line"
            res[comm] = got
        finally:
            rc = s.stop()
        assert rc == 0, f"TP 2 {comm}: exit {rc}"
    assert res[comms[0]] == res[comms[1]], f"{comms[0]} and {comms[1]} differ (both must be the rank-order f32 sum)"
    if dev == "cuda":  # graphs vs eager on the same communicator
        s = sp.Server([*common, "--tensor-parallel-size", "2", "--tp-comm", "cuda_ipc", "--enforce-eager"], model=MINI)
        try:
            eager = [complete(s, p) for p in PROMPTS]
        finally:
            rc = s.stop()
        assert rc == 0, f"TP 2 cuda_ipc --enforce-eager: exit {rc}"
        assert eager == res["cuda_ipc"], "TP 2 cuda_ipc: graph replays differ from --enforce-eager"
        print("TP 2 cuda_ipc: CUDA graphs on both ranks == --enforce-eager == shm, bit for bit")
    if dev == "cuda":  # nccl, for function: 2 ranks of one GPU need a distinct NCCL_HOSTID each (GPU-NOTES section 1)
        try:
            s = sp.Server([*common, "--tensor-parallel-size", "2", "--tp-comm", "nccl"], model=MINI,
                          env={"SPECD_TP_NCCL_HOSTID_PER_RANK": "1"}, ready_timeout=120)
        except RuntimeError as e:
            if "nccl: cannot load" not in str(e):
                raise
            print(f"note: --tp-comm nccl not checked: libnccl is not loadable here ({str(e)[-200:]})")
        else:
            try:
                got = [complete(s, p) for p in PROMPTS]
                for i, g in enumerate(got):
                    compare_tp1(f"TP 2 nccl prompt {i}", ref[i], g)
                print("TP 2 --tp-comm nccl (sockets over loopback): greedy vs TP 1 ok")
            finally:
                rc = s.stop()
            assert rc == 0, f"TP 2 nccl: exit {rc}"
    draft_checks(common, dev, comms[0])
    print(f"TP 2 on {dev} (one device): {len(PROMPTS)} prompts x {MAX_TOK} greedy tokens vs TP 1 ok; {comms[0]} == "
          f"{comms[1]} bit for bit (tokens, logprobs); rerun identical")


if __name__ == "__main__":
    main_gpu() if GPU else main_cpu()
    print("OK")
