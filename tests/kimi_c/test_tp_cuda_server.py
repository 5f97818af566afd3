#!/usr/bin/env python3
"""test_tp_cuda_server.py: `specd serve` on the Kimi miniature with --device cuda --tensor-parallel-size N
(issues 18 + 19). server/bundle.c used to refuse DeepSeek-V3 / Kimi at TP > 1 on cuda ("runs on the CPU
backend only for now"); every rank now runs its shard of the device forward (docs/kimi-k2.5.md, "Tensor
parallelism on GPU ranks"), so only the GPU itself, or a shard the model cannot cut, stops it.

Without a usable GPU (ctest kimi_c_tp_cuda, label unit):
  - `serve k25 --device cuda --tensor-parallel-size 2` and `serve wide8 ... 4` exit non-zero within
    30 s (test_tp_cuda.refuses) naming a rank's GPU probe reason ("--device cuda: rank R: no usable GPU (device 0): <kn_probe's
    reason>"), nothing mentions the old refusal ("CPU backend only", "DeepSeek"), no rank process is left;
  - the same model at TP 2 with --device cpu passes --check-config (the configuration itself is fine).
  With a usable GPU this mode exits 77 (the --gpu mode covers it).

With a GPU (`--gpu`, ctest kimi_c_tp_cuda_gpu, label gpu, run by tools/gpu_check.sh with the system python;
exits 77 here with the reason, or without the miniature's tokenizer files), the 8-head miniature "wide8"
(experts of width 256: they split at TP 4) served on the ONE GPU: TP 1, then TP 2 with --tp-comm cuda_ipc
(twice: a rerun) and shm, then TP 4 with cuda_ipc, every rank a process on the same device:
  - greedy /v1/completions (MAX_TOK tokens, 4 prompts, logprobs 2): TP N tokens == TP 1's, except after a
    near-tie (TP 1's top-2 gap below TIE_NATS at the first difference); every sampled-token logprob within
    LP_BOUND nats of TP 1's before any difference. The bound: each of TP 1 and TP N is within 2e-3 x max|logit|
    of the CPU (cuda_kimi's bound; max|logit| <= 5.4 on this model, backend_cuda_kimi_tp), so their logits are
    within 2.2e-2 of each other and a logprob within twice that; the CPU's TP 2 / 4 (bf16 latent) stay within
    6e-4 x max|logit| of TP 1 (backend_cuda_kimi_tp);
  - TP 2 cuda_ipc == shm bit for bit (tokens and every logprob float: both the rank-order f32 sum), and a rerun
    on cuda_ipc identical (bit-reproducible run to run);
  - each rank logs its "cuda plan" line and /metrics has every rank's weights and KV bytes, a rank's weights
    below TP 1's;
  - k25 at TP 4 is refused at load with the int4-group reason (16 of 64 expert columns per rank).
SPECD_TP_TEST_DEVICE=cpu runs the --gpu mode's logic on the CPU (comms shm and auto) to check the script.
Run: python tests/kimi_c/test_tp_cuda_server.py [--gpu]
"""
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pyutil"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "server"))
import specd_server as sp  # noqa: E402
from test_tp_cuda import refuses  # noqa: E402  (serve ARGS must exit non-zero naming a reason, no rank left)

GPU = "--gpu" in sys.argv[1:]
ROOT = os.environ.get("KIMI_C_MINI_DIR", os.path.join(sp.BUILD, "kimi_c_mini"))
K25, WIDE = os.path.join(ROOT, "k25"), os.path.join(ROOT, "wide8")
TIE_NATS = 5e-2
LP_BOUND = 5e-2
PROMPTS = ["The capital of France is", "def fib(n):", "1 2 3 4 5", "Once upon a time"]
MAX_TOK = 24


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


def have(model, tok=True):
    return os.path.exists(os.path.join(model, "config.json")) and (
        not tok or os.path.exists(os.path.join(model, "tiktoken.model")))


def main_cpu():
    if not os.access(sp.SPECD, os.X_OK) or not have(K25, tok=False) or not have(WIDE, tok=False):
        skip(f"need {sp.SPECD} and the miniatures under {ROOT}")
    why = gpu_reason(K25)
    if why is None:
        skip("a GPU is usable here: kimi_c_tp_cuda_gpu (--gpu) runs instead")
    common = ["--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "16M"]
    for model, n in ((K25, 2), (WIDE, 4)):
        out = refuses(["--device", "cuda", "--tensor-parallel-size", str(n), *common],
                      r"--device cuda: rank \d: no usable GPU \(device 0\): \S.{10,}", model=model)
        assert why in out, f"the reason must be kn_probe's ({why}): {out[-2000:]}"
        assert "CPU backend only" not in out and "DeepSeek" not in out, f"the old refusal: {out[-3000:]}"
    p = subprocess.run([sp.SPECD, "serve", K25, "--check-config", "--device", "cpu", "--tensor-parallel-size", "2",
                        *common], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"k25 at TP 2 on the CPU must pass --check-config: {p.stdout + p.stderr}"[-3000:]
    print(f"no GPU: k25 TP 2 and wide8 TP 4 on cuda refused at the GPU probe only ({why})")


def complete(server, prompt):
    st, data, _ = server.raw("POST", "/v1/completions", {"model": "kimi", "prompt": prompt, "max_tokens": MAX_TOK,
                                                          "temperature": 0, "logprobs": 2, "ignore_eos": True})
    assert st == 200, (st, data[:500])
    lp = json.loads(data)["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]


def compare_tp1(name, ref, got):
    """TP N tokens == TP 1's, except after a near-tie of TP 1's; logprobs within LP_BOUND before. Returns the
    largest logprob difference seen."""
    (t1, l1, top1), (t2, l2, _) = ref, got
    worst = 0.0
    for i, (a, b) in enumerate(zip(t1, t2)):
        if a != b:
            vals = sorted(top1[i].values(), reverse=True)
            gap = vals[0] - vals[1] if len(vals) > 1 else float("inf")
            assert gap < TIE_NATS, f"{name}: token {i} {b!r} vs TP 1's {a!r} at a top-2 gap of {gap:.3g} nats"
            print(f"{name}: differs from TP 1 at token {i} after a near-tie ({gap:.3g} nats)")
            return worst
        worst = max(worst, abs(l1[i] - l2[i]))
        assert abs(l1[i] - l2[i]) <= LP_BOUND, f"{name}: token {i} logprob {l2[i]} vs TP 1's {l1[i]}"
    assert len(t1) == len(t2) == MAX_TOK, (len(t1), len(t2))
    return worst


def main_gpu():
    if not os.access(sp.SPECD, os.X_OK):
        skip(f"need {sp.SPECD}")
    if not have(WIDE) or not have(K25, tok=False):
        skip(f"need the miniatures with their tokenizer under {ROOT} (make_minis.py with the Kimi tiktoken.model: "
             f"SPECD_KIMI_DATA or ../shared/data/kimi-k2)")
    dev = os.environ.get("SPECD_TP_TEST_DEVICE", "cuda")
    why = gpu_reason(WIDE) if dev == "cuda" else None
    if why is not None:
        skip(f"no usable GPU: {why}")
    comms = ("cuda_ipc", "shm") if dev == "cuda" else ("shm", "auto")
    common = ["--device", dev, "--max-model-len", "256", "--threads", "1", "--served-model-name", "kimi",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    common += ["--gpu-memory-utilization", "0.05"] if dev == "cuda" else ["--kv-cache-memory", "16M"]
    s1 = sp.Server(common, model=WIDE)
    try:
        ref = [complete(s1, p) for p in PROMPTS]
        w1 = s1.metrics().get('specd_rank_weight_bytes{rank="0"}')
    finally:
        s1.stop()
    res, worst = {}, {}
    for n, comm in ((2, comms[0]), (2, comms[1]), (4, comms[0])):
        s = sp.Server([*common, "--tensor-parallel-size", str(n), "--tp-comm", comm], model=WIDE)
        try:
            got = [complete(s, p) for p in PROMPTS]
            worst[(n, comm)] = max(compare_tp1(f"TP {n} {comm} prompt {i}", ref[i], g) for i, g in enumerate(got))
            if (n, comm) == (2, comms[0]):
                again = [complete(s, p) for p in PROMPTS]
                assert again == got, f"TP 2 {comm}: a rerun differs (not bit-reproducible)"
            m = s.metrics()
            for r in range(n):
                wb, kv = m.get(f'specd_rank_weight_bytes{{rank="{r}"}}'), m.get(f'specd_rank_kv_cache_bytes{{rank="{r}"}}')
                assert wb and kv and wb > 0 and kv > 0, (n, r, wb, kv)
                assert not w1 or wb < w1, f"TP {n} rank {r} weights {wb} not below TP 1's {w1}"
            log = s.read_log(400000)
            for r in range(n) if dev == "cuda" else ():
                assert re.search(rf"rank {r}/{n} on GPU \d+ .*cuda plan:", log), f"TP {n}: no cuda plan line of rank {r}"
            res[(n, comm)] = got
        finally:
            rc = s.stop()
        assert rc == 0, f"TP {n} {comm}: exit {rc}"
    assert res[(2, comms[0])] == res[(2, comms[1])], \
        f"TP 2 {comms[0]} and {comms[1]} differ (both must be the rank-order f32 sum)"
    refuses([*common, "--tensor-parallel-size", "4"], r"cannot be split \(16 of its 64 input columns per rank would "
            r"cut a 32-value block", model=K25)
    print(f"wide8 on {dev} (one device): TP 2 and TP 4 vs TP 1, {len(PROMPTS)} prompts x {MAX_TOK} greedy tokens ok "
          f"(largest logprob difference: " + ", ".join(f"TP {n} {c} {w:.3g}" for (n, c), w in worst.items()) +
          f" nats, bound {LP_BOUND}); TP 2 {comms[0]} == {comms[1]} bit for bit; rerun identical; k25 at TP 4 refused")


if __name__ == "__main__":
    main_gpu() if GPU else main_cpu()
    print("OK")
