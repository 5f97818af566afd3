#!/usr/bin/env python3
"""test_device_server.py (kimi_c_device_server): `specd serve --device cuda` on the Kimi miniature (issue 19).

server/bundle.c used to refuse every DeepSeek-V3 / Kimi model on cuda ("no CUDA ops yet"); the model now runs
on the CUDA backend (engine/model/deepseek_v3_fwd.c on device tensors), so the bundle plans it (bf16 latent KV,
the MLA scratch and the MoE buffers in bk_cuda_opts) and only the GPU itself can be missing.

Without a usable GPU (this CI machine; or a build without CUDA):
  - `serve MINI --device cuda --check-config` and `serve MINI --device cuda` exit non-zero and name the probe's
    reason ("--device cuda: no usable GPU: ..."), and nothing mentions a DeepSeek-V3 / Kimi refusal;
  - `serve MINI --check-config` (auto) passes.
With a usable GPU (tools/gpu_check.sh runs this file with the system python):
  - `serve MINI --device cuda` starts: the log has the "cuda plan:" line and the CUDA graphs' capture line (the
    DeepSeek-V3 decode step captured per bucket); 4 completions at temperature 0 answer 200 with 8 tokens each, and the same 4
    requests sent concurrently give the same texts (batch invariance through the server).
Exits 77 without the binary or the miniature (KIMI_C_MINI_DIR/k25 with its tokenizer).
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

SPECD = os.environ.get("SPECD_BIN") or os.path.join(os.environ.get("SPECD_BUILD_DIR", ""), "server", "specd")
MINI = os.path.join(os.environ.get("KIMI_C_MINI_DIR", ""), "k25")
COMMON = ["--served-model-name", "kimi-mini", "--max-model-len", "256", "--kv-cache-memory", "32M", "--threads", "1",
          "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
PROMPTS = ["The capital of France is", "def fib(n):", "你好，世界", "1 2 3 4 5"]


def run(*args, timeout=120):
    p = subprocess.run([SPECD, *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p.returncode, p.stdout + p.stderr


def post(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def gpu_side():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="specd_kimi_cuda_", suffix=".log", delete=False)
    proc = subprocess.Popen([SPECD, "serve", MINI, "--port", str(port), "--device", "cuda", *COMMON], stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None and time.time() < deadline, open(log.name).read()[-4000:]
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.3)
        text = open(log.name).read()
        assert "cuda plan:" in text, text[-4000:]
        assert "cuda graphs:" in text and "captured" in text, text[-4000:]
        body = lambda p: {"model": "kimi-mini", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        alone = []
        for p in PROMPTS:
            st, r = post(port, body(p))
            assert st == 200 and r["usage"]["completion_tokens"] == 8, (st, r)
            alone.append(r["choices"][0]["text"])
        together = [None] * len(PROMPTS)

        def one(i):
            together[i] = post(port, body(PROMPTS[i]))

        th = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in th:
            t.start()
        for t in th:
            t.join()
        for i, (st, r) in enumerate(together):
            assert st == 200 and r["choices"][0]["text"] == alone[i], (i, st, r, alone[i])
        print(f"--device cuda: served {len(PROMPTS)} greedy completions, concurrent == alone: {alone}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    if not os.path.exists(SPECD) or not os.path.exists(os.path.join(MINI, "config.json")):
        print(f"skip: need {SPECD} and the miniature {MINI}")
        return 77
    if not os.path.exists(os.path.join(MINI, "tiktoken.model")):
        print(f"skip: the miniature {MINI} has no tokenizer (written without shared/data)")
        return 77
    rc, out = run("serve", MINI, "--device", "cuda", "--check-config", *COMMON)
    if rc == 0:
        print("a usable GPU is present: serving the miniature on it")
        gpu_side()
        print("OK")
        return 0
    assert "--device cuda: no usable GPU: " in out, f"--device cuda must be refused for the GPU only: {rc} {out[-3000:]}"
    reason = out.split("--device cuda: no usable GPU: ")[1].splitlines()[0].strip()
    assert len(reason) > 10, reason
    assert "DeepSeek" not in out and "Kimi models" not in out, out[-3000:]
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    rc, out = run("serve", MINI, "--port", str(port), "--device", "cuda", *COMMON)
    assert rc != 0 and f"--device cuda: no usable GPU: {reason}" in out, f"{rc} {out[-3000:]}"
    assert "DeepSeek" not in out, out[-3000:]
    rc, out = run("serve", MINI, "--check-config", *COMMON)
    assert rc == 0, f"--check-config with the default device (auto) must pass: {rc} {out[-3000:]}"
    print(f"no GPU: --device cuda refused with the probe's reason only ({reason}); auto falls back to the CPU")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
