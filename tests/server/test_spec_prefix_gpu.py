"""Prefix caching with a speculating EAGLE-3 draft on the GPU: the device feature cache (ctest
server_spec_prefix_gpu, label gpu, run by tools/gpu_check.sh with the system python3; exits 77 here with the
reason). docs/engine.md "The draft head on the GPU".

On the tiny HF Llama (tools/gen_llama_hf_mini.py) with a random head of its shapes
(tools/eagle3/make_random_head.py, numpy only), k = 3 fixed, greedy:
  - `serve --device cuda --enable-prefix-caching --draft HEAD` logs the draft's feature pool as the device
    feature cache, its plan line counts the cache (its GiB > 0), and it does NOT log that prefix-cache hits
    are not taken;
  - two requests sharing a prefix of 100+ tokens: the second hits it (specd_prefix_cache_hits_total grows by
    at least 64 tokens);
  - both requests' texts, and each request's speculation counters (drafts, draft tokens, accepted), equal
    those of the same two requests on a server WITHOUT prefix caching (cold every time): the cached positions'
    features fed the draft the bits a cold prefill computes (the random head accepts next to nothing, so the
    counters mostly check that drafts were made the same number of times).
SPECD_PREFIX_TEST_DEVICE=cpu: a dry run of this script's logic on the CPU (host features, the host aux_pool;
the device-only log and plan checks are skipped).
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyutil"))
import specd_server as sp  # noqa: E402

MINI = os.path.join(os.environ.get("MODEL_HF_MINI_DIR", os.path.join(sp.BUILD, "model_hf_mini")), "f32")
KEYS = ["specd_prefix_cache_hits_total", "specd_spec_decode_num_drafts_total",
        "specd_spec_decode_num_draft_tokens_total", "specd_spec_decode_num_accepted_tokens_total"]


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


def main():
    if not os.access(sp.SPECD, os.X_OK):
        skip(f"need {sp.SPECD}")
    if not os.path.exists(os.path.join(MINI, "tokenizer.json")):
        skip(f"need {MINI} (tools/gen_llama_hf_mini.py)")
    dev = os.environ.get("SPECD_PREFIX_TEST_DEVICE", "cuda")
    why = gpu_reason(MINI) if dev == "cuda" else None
    if why is not None:
        skip(f"no usable GPU: {why}")
    head = tempfile.mkdtemp(prefix="specd_prefix_head_")
    subprocess.run([sys.executable, os.path.join(sp.SRC, "tools", "eagle3", "make_random_head.py"), "--layout",
                    "speculators", "--out", head, "--seed", "11", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--inter", "176", "--target-vocab", "512", "--draft-vocab", "256",
                    "--target-layers", "3", "--aux-ids", "0,1,2", "--verifier", MINI], check=True,
                   stdout=subprocess.DEVNULL)
    shared = "The harbour was grey that morning and the boats rocked gently on the water. " * 6
    prompts = [shared + "Tell me about the boats.", shared + "Tell me about the sky."]
    common = ["--device", dev, "--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--threads", "1",
              "--served-model-name", "mini", "--max-num-seqs", "8", "--draft", head, "--num-speculative-tokens", "3",
              "--no-speculative-adaptive"]
    runs = {}
    for prefix in (False, True):
        s = sp.Server(common + (["--enable-prefix-caching"] if prefix else []), model=MINI)
        try:
            texts, deltas = [], []
            for p in prompts:
                m0 = s.metrics()
                st, body = s.post("/v1/completions", {"model": "mini", "prompt": p, "max_tokens": 32,
                                                      "temperature": 0})
                assert st == 200, (st, body)
                m1 = s.metrics()
                texts.append(body["choices"][0]["text"])
                deltas.append([m1.get(k, 0) - m0.get(k, 0) for k in KEYS])
            log = s.read_log(400000)
        finally:
            rc = s.stop()
        assert rc == 0, f"server (prefix caching {prefix}): exit {rc}"
        runs[prefix] = (texts, deltas)
        if prefix and dev == "cuda":
            assert "its feature pool the device feature cache" in log, log[-3000:]
            plan = re.search(r"its device feature cache (\d+\.\d+) GiB", log)
            assert plan and float(plan.group(1)) > 0, f"the plan must count the device feature cache: {log[-3000:]}"
            assert "prefix-cache hits are not taken" not in log, log[-3000:]
            print(f"plan: the device feature cache {plan.group(1)} GiB")
    texts, deltas = runs[True]
    assert deltas[1][0] >= 64, f"the second request must hit the shared prefix: {runs}"
    assert runs[False][1][1][0] == 0, f"no prefix caching, yet hits: {runs[False]}"
    assert texts == runs[False][0], f"texts with prefix caching differ from cold: {runs}"
    for i in range(2):
        assert deltas[i][1:] == runs[False][1][i][1:], f"request {i}: speculation counters differ from cold: {runs}"
    assert deltas[1][1] > 0, f"the hit request made no drafts: {runs}"
    print(f"{dev}: the second request hit {deltas[1][0]:.0f} prompt tokens; texts and "
          f"speculation counters (drafts, draft tokens, accepted per request: {[d[1:] for d in deltas]}) == no "
          f"prefix caching")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
